"""Scripts run from a checkout (`python tools/NAME.py`), not shipped: the top layer of the house, so they may import
anything (bench/ too) and nothing imports them (pyproject.toml's import contracts)."""
