"""The launcher's choices, without torch."""

import unittest

from prism_emulate.launch import choose_backend, parse_args


class Launcher(unittest.TestCase):
    def test_nccl_and_gloo_become_prism(self):
        for b in [None, "nccl", "gloo", "NCCL", "cuda:nccl,cpu:gloo"]:
            self.assertEqual(choose_backend(b, keep=False), "prism")
            self.assertEqual(choose_backend(b, keep=True), "prism")
        self.assertEqual(choose_backend("custom", keep=True), "custom")
        self.assertEqual(choose_backend("custom", keep=False), "prism")

    def test_arguments(self):
        self.assertEqual(parse_args(["train.py", "--lr", "1"]), (False, None, "train.py", ["train.py", "--lr", "1"]))
        self.assertEqual(parse_args(["--keep-backend", "--", "t.py"]), (True, None, "t.py", ["t.py"]))
        self.assertEqual(parse_args(["-m", "pkg.train", "x"]), (False, "pkg.train", None, ["pkg.train", "x"]))
        for bad in [[], ["--nope", "t.py"], ["-m"]]:
            with self.assertRaises(SystemExit):
                parse_args(bad)


if __name__ == "__main__":
    unittest.main()
