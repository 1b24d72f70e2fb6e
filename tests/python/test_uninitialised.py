"""Objects made by Class.__new__(Class) without __init__: pybind11 (2.10) hands their methods raw
memory in which no C++ object was ever made, a segfault or garbage (a Tensor's __dlpack__ exported
whatever lay there). Every method and property of every class the extension exports, called on such
an object or given one as an argument, raises TypeError naming __new__ instead; the package's own
classes raise too. It runs in its own process: what it guards against is a crash."""
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

CHECKS = r"""
import faulthandler, os, sys, types
faulthandler.enable()
import torch
import shardckpt as sc
from shardckpt import _core

path = os.path.join(sys.argv[1], "a.h5")
spec = sc.ParamSpec("w", sc.plain_sections(4), [8])
param = lambda: sc.ShardedParam(spec, 1, 0, 0, 0, shard=torch.zeros(4, 8))
# What each method needs besides self (none: nothing); every argument is a good one.
ARGS = {
    ("Saver", "save"): lambda: (sc.StateDict(), path),
    ("Saver", "save_async"): lambda: (sc.StateDict(), path),
    ("Checkpoint", "load_into"): lambda: (sc.StateDict(),),
    ("Checkpoint", "load"): lambda: (sc.StateDict(),),
    ("ShardedParam", "optimizer_state"): lambda: ("exp_avg",),
    ("ShardedParam", "shard_of"): lambda: (torch.zeros(4, 8),),
    ("StateDict", "add"): lambda: (param(),),
    ("StateDict", "add_common"): lambda: ("step", 1),
    ("StateDict", "add_local"): lambda: ("step", 1),
    ("Section", "__eq__"): lambda: (sc.Section("a", 1),),
    ("TpDivisor", "__eq__"): lambda: (sc.TpDivisor("heads", 8),),
}
SETTERS = {"shard": lambda: torch.zeros(4, 8)}  # any other property set takes an int
SKIP = {"__init__", "__new__", "__doc__", "__module__", "__dict__", "__weakref__"}

def refused(what, f):
    try:
        f()
    except TypeError as e:
        assert "__new__" in str(e), f"{what}: {e}"
        print("refused", what)
        return
    raise AssertionError(f"{what}: ran on an object whose __init__ never ran")

classes = [c for c in vars(_core).values() if isinstance(c, type) and not issubclass(c, BaseException)]
assert len(classes) == 11, classes
for cls in classes:
    for name, attr in vars(cls).items():
        if name in SKIP or attr is None or isinstance(attr, (staticmethod, types.BuiltinFunctionType)):
            continue
        o = cls.__new__(cls)
        what = f"{cls.__name__}.{name}"
        if isinstance(attr, property):
            refused(what, lambda: attr.fget(o))
            if attr.fset is not None:
                refused(what + " =", lambda: attr.fset(o, SETTERS.get(name, lambda: 1)()))
        else:
            args = ARGS.get((cls.__name__, name), lambda: ())()
            refused(what, lambda: getattr(o, name)(*args))
# Such an object as an argument.
new = lambda cls: cls.__new__(cls)
refused("StateDict.add(ShardedParam.__new__)", lambda: sc.StateDict().add(new(sc.ShardedParam)))
refused("StateDict.add(ShardedTensor.__new__)", lambda: sc.StateDict().add(new(sc.ShardedTensor)))
refused("save(StateDict.__new__)", lambda: sc.save(new(sc.StateDict), path))
refused("load_into(StateDict.__new__)", lambda: sc.load_into(path, new(sc.StateDict)))
refused("ParamSpec([Section.__new__])", lambda: sc.ParamSpec("w", [new(sc.Section)], [8]))
refused("ParamSpec(divisors=[TpDivisor.__new__])",
        lambda: sc.ParamSpec("w", sc.plain_sections(4), [8], divisors=[new(sc.TpDivisor)]))
refused("ShardedParam(ParamSpec.__new__)", lambda: sc.ShardedParam(new(sc.ParamSpec), 1, 0, 0, 0))
refused("gdp_in_proj_sections(SsmDims.__new__)", lambda: sc.gdp_in_proj_sections(new(sc.SsmDims), 1))
refused("ShardedParam(shard=Tensor.__new__)", lambda: sc.ShardedParam(spec, 1, 0, 0, 0, shard=new(_core.Tensor)))
refused("torch.from_dlpack(Tensor.__new__)", lambda: torch.utils.dlpack.from_dlpack(new(_core.Tensor)))
# The package's Python classes.
saver = new(sc.Saver)
for name in ("save", "save_async"):
    refused(f"sc.Saver.{name}", lambda: getattr(saver, name)(sc.StateDict(), path))
for name in ("close", "async_host_bytes", "staging_bytes"):
    refused(f"sc.Saver.{name}", lambda: getattr(saver, name)())
try:
    sc.save(sc.StateDict(), path, new(sc.TorchGroup))
    raise AssertionError("a TorchGroup.__new__ ran a save")
except sc.Error as e:
    assert e.code == "collective", e
    print("refused save(group=TorchGroup.__new__):", e)
# The package's Checkpoint over a Checkpoint.__new__ of the binding's.
ckpt = sc.Checkpoint(new(_core.Checkpoint))
for name, args in (("inspect", ()), ("load_into", (sc.StateDict(),)), ("load", (sc.StateDict(),)), ("close", ())):
    refused(f"sc.Checkpoint.{name}", lambda: getattr(ckpt, name)(*args))
refused("sc.Checkpoint.checkpoint_id", lambda: ckpt.checkpoint_id)
print("all refused")
"""


class Uninitialised(unittest.TestCase):
    def test_every_method_of_an_object_whose_init_never_ran_raises(self):
        with tempfile.TemporaryDirectory(prefix="sc-new-") as d:
            p = subprocess.run([sys.executable, "-c", CHECKS, d], capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, f"exit status {p.returncode}:\n{p.stdout}\n{p.stderr}")
        self.assertIn("all refused", p.stdout)
        refused = p.stdout.count("refused ")
        self.assertGreaterEqual(refused, 60, p.stdout)  # every method and property of the 11 classes


if __name__ == "__main__":
    unittest.main()
