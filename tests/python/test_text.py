"""Text between Python and the library: a path that is not UTF-8 (Linux paths are bytes) saves and
loads, and an error naming it is shardckpt.Error showing its bytes as \\xNN, not a UnicodeDecodeError;
a str with a lone surrogate (no UTF-8 form) as a key or a value is a ValueError naming it, not
pybind11's "Unable to cast"; verify gives the answer `shardckpt verify` gives for the same file."""
import os
import shutil
import subprocess
import tempfile
import unittest

import h5py
import torch

import shardckpt as sc

CLI = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(sc.__file__)))), "shardckpt")


def state(t):
    s = sc.StateDict()
    s.add(sc.ShardedParam(sc.ParamSpec("w", sc.plain_sections(t.shape[0]), [t.shape[1]]), 1, 0, 0, 0, shard=t))
    return s


class Text(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="sc-text-")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_a_path_that_is_not_utf8_saves_loads_and_is_named_in_errors(self):
        path = os.path.join(self.dir, os.fsdecode(b"\xff\xfe.h5"))  # lone surrogates: the bytes of the name
        t = torch.arange(32.0).view(4, 8)
        sc.save(state(t), path)
        self.assertTrue(os.path.exists(os.fsencode(path)))
        self.assertTrue(torch.equal(sc.read(path)["w"], t))
        missing = os.path.join(self.dir, os.fsdecode(b"gone\xff"), "a.h5")
        for call in (lambda: sc.load_into(missing, sc.StateDict()), lambda: sc.save(state(t), missing),
                     lambda: sc.verify(missing), lambda: sc.inspect(missing)):
            with self.assertRaises(sc.Error) as e:
                call()
            self.assertIn("gone\\xff", str(e.exception))
            str(e.exception).encode("utf-8")  # printable: no lone surrogate in it

    def test_a_str_without_utf8_as_a_key_or_a_value_is_a_value_error_naming_it(self):
        s = sc.StateDict()
        for call, named in ((lambda: s.add_common("run", "a\udc80b"), "key run: the value 'a\\udc80b'"),
                            (lambda: s.add_local("run", "\ud800"), "key run: the value '\\ud800'"),
                            (lambda: s.add_common("k\udc80", 1), "key 'k\\udc80'"),
                            (lambda: sc.ParamSpec("w\udc80", sc.plain_sections(4), [8]), "key 'w\\udc80'"),
                            (lambda: sc.ShardedTensor("t\udc80", torch.zeros(2), [2], [0]), "key 't\\udc80'")):
            with self.assertRaises(ValueError) as e:
                call()
            self.assertIn(named, str(e.exception))
            self.assertIn("lone surrogate", str(e.exception))
        self.assertEqual(len(s), 0)
        s.add_common("run", "naïve ✓")  # any text is fine
        path = os.path.join(self.dir, "a.h5")
        sc.save(s, path)
        self.assertEqual(sc.inspect(path)["common"], {"run": "naïve ✓"})

    @unittest.skipUnless(os.path.exists(CLI), "no shardckpt tool beside this package (an installed package)")
    def test_verify_answers_as_the_cli_does(self):
        t = torch.rand(64, 8)
        answers = {}
        for checksums in (True, False):
            for damaged in (False, True):
                path = os.path.join(self.dir, f"{checksums}-{damaged}.h5")
                sc.save(state(t), path, checksums=checksums)
                if damaged:
                    with h5py.File(path, "r") as f:
                        offset = f["w"].id.get_offset()
                    with open(path, "r+b") as f:
                        f.seek(offset + 5)
                        f.write(b"\x7f")
                cli = subprocess.run([CLI, "verify", path], capture_output=True, text=True).returncode
                try:
                    sc.verify(path)
                    python = "verified"
                except sc.Error as e:
                    python = e.code
                answers[checksums, damaged] = (cli, python)
        self.assertEqual(answers, {(True, False): (0, "verified"), (True, True): (1, "corrupt"),
                                   (False, False): (1, "invalid_argument"), (False, True): (1, "invalid_argument")})


if __name__ == "__main__":
    unittest.main()
