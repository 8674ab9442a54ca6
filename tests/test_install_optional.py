"""Optional packages missing: the command still runs and says what to install for what it skipped."""
from __future__ import annotations

import json
import sys

from warploop import cli


def test_bench_decode_without_transformers_skips_its_peer_with_the_install_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail here
    # the batch-8/32 and TTFT figures are not what this is about (test_llm_bench checks them)
    code = cli.main(["bench", "decode", "--json", "--steps", "2", "--repeats", "1", "--batches", "2", "--no-ttft"])
    out, err = capsys.readouterr()
    data = json.loads(out)["models"]["small-cpu"]
    assert code == 0 and data["warploop"]["ms_per_token_bs1"] > 0
    assert data["hf_eager"] == {"skipped": "needs transformers: pip install transformers"}
    assert data["warploop"]["check"] == data["hf_eager"]
    assert "pip install transformers" in err
