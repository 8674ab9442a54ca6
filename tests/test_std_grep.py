"""The GPU-native grep example: the device reads files through std file calls and counts matching
lines; its last output line must equal a plain Python count. Runs as a user would run it (on the
CPU the example switches the Triton interpreter on for itself)."""
from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "gpu_grep.py")


def python_count(root, pattern: bytes) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                total += sum(pattern in line for line in f.read().split(b"\n"))
    return total


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("grep")
    (root / "sub").mkdir()
    rng = random.Random(4)
    words = ["needle", "need", "le", "hay", "needleneedle", "x" * 30, "ne", "edle"]
    for i in range(5):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 9))) for _ in range(rng.randint(0, 150))]
        text = "\n".join(lines) + ("\n" if i % 2 else "")           # with and without a final newline
        (root / ("sub" if i > 2 else "") / f"f{i}.txt").write_text(text)
    (root / "empty.txt").write_text("")
    (root / "edge.txt").write_text("needle" * 40 + "\n\n" + "x" * 150 + "needle\nneedl")   # crosses chunks
    return root


def run_grep(*args) -> list[str]:
    done = subprocess.run([sys.executable, EXAMPLE, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()


def test_grep_matches_python_with_small_chunks(tree):
    # 200-byte chunks: matches and lines straddle reads; three programs share seven files.
    lines = run_grep("needle", tree, "--chunk", 200, "--programs", 3)
    expected = python_count(tree, b"needle")
    assert expected > 100
    assert int(lines[-1]) == expected
    per_file = {line.split(": ")[0]: int(line.split(": ")[1]) for line in lines if ": " in line}
    assert per_file["edge.txt"] == 2 and "empty.txt" not in per_file
    assert sum(per_file.values()) == expected


def test_grep_no_match_and_bad_pattern(tree):
    assert run_grep("zebra", tree)[-1] == "0"
    done = subprocess.run([sys.executable, EXAMPLE, "x" * 65, str(tree)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "1-64 bytes" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("args, message", [
    (("", ), "pattern: 0 bytes"),
    (("needle", "--chunk", "3"), "--chunk 3: must be at least the pattern's 6 bytes"),   # it read forever
    (("needle", "--programs", "0"), "--programs 0: must be at least 1"),                # a traceback
])
def test_grep_refuses_bad_arguments_naming_them(tree, capsys, args, message):
    """In this process (the refusals come before any kernel): a usage error, status 2, no traceback."""
    spec = importlib.util.spec_from_file_location("gpu_grep", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with pytest.raises(SystemExit) as exit_:
        example.main([args[0], str(tree), *args[1:]])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_grep_refuses_a_folder_that_is_not_there(tmp_path):
    """A mistyped folder is an error naming it, not a count of 0 (it printed 0 before)."""
    for where in (tmp_path / "missing", tmp_path / "file.txt"):
        if where.name.endswith(".txt"):
            where.write_text("needle\n")
        done = subprocess.run([sys.executable, EXAMPLE, "needle", str(where)], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and "not a directory" in done.stderr and str(where) in done.stderr
