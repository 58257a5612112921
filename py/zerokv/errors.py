"""zerokv.ZeroKVError: the one exception type every zerokv refusal is (or subclasses).

It lives at the bottom of the dependency graph so that every area (kvwrite, tensorrt, aoti,
executorch) can subclass it without importing another. Each subclass keeps the builtin base it had
before (ValueError, RuntimeError), so code that caught those still does.
"""


class ZeroKVError(Exception):
    """zerokv refused the input: the message names what is at fault (the buffer, input or option, and
    the method) and how to fix it. Nothing was changed or written."""
