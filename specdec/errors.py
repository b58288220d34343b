"""The one exception type users see: its message says what is wrong and what to do."""


class SpecdecError(Exception):
    """A user-facing error: bad input, a missing model, a corrupt file.

    The CLI prints ``error: <message>`` on one line and exits with status 2; the server turns it
    into a 4xx response. Anything else escaping is a bug.
    """
