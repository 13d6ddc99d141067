"""The one exception kvrag's user-facing paths raise (at the bottom of the house: every layer may import it)."""


class KvragError(Exception):
    """A user-facing error: the CLI prints its message as one line on stderr and exits 1."""
