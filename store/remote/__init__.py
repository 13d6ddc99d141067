"""A shared KV store on S3-compatible object storage (`--store s3://bucket/prefix`; docs/design.md, "Object storage").

    object_store.py  ObjectStore: one bucket and prefix over obstore, configured from the AWS variables
    layout.py        one chunk = one object: header, KVRecord, every layer's value; its checks
    remote_kv.py     RemoteKVTable: the KVTable protocol (store/table.py) over those objects, plus get_chunk
    cached_kv.py     CachedKVTable: the LocalKVTable as a size-bounded read-through tier in front of it
    ranged.py        a cold chunk fetched in layer order, a few layers per ranged GET, while its first layers are read

Which table a store gets is store/open.py's choice. The local mirror of a remote store (its corpus, a published
snapshot, and its kv cache) is corpus/mirror.py: it syncs the corpus, which the store knows nothing of. obstore is an
optional dependency (the `s3` extra): only these modules import it.
"""
