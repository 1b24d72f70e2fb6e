"""Which megatron-core the tests of this directory run against (PYTHONPATH first: build/megatron-0.19.2
for the megatron-0.19 test, else build/peers-venv's 0.16.1), for their skips."""


def megatron_version():
    """megatron.core.__version__ ("0.19.2", "0.19.2+<git hash>"), or None without megatron-core."""
    try:
        import megatron.core
    except ImportError:
        return None
    return megatron.core.__version__


def older_than(version, wanted):
    """Whether `version` (megatron_version()'s) is None, unreadable or older than `wanted` (a tuple)."""
    try:
        return tuple(int(p) for p in version.split("+")[0].split(".")[:len(wanted)]) < tuple(wanted)
    except (AttributeError, ValueError):
        return True
