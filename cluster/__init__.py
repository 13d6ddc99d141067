"""`kvrag serve --ray-serve N`: engine replicas on Ray Serve behind a front that routes each request by its chunks."""
