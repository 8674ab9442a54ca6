"""`warploop bench decode` without a GPU: a small config, every contract key present."""
from __future__ import annotations

import json

from warploop import cli

KEYS = ("ms_per_token_bs1", "tok_s_bs8", "tok_s_bs32", "ttft_ms_1024")


def test_bench_decode_on_cpu_prints_the_contract_keys(capsys, tmp_path):
    code = cli.main(["bench", "decode", "--json", "--steps", "2", "--repeats", "1", "--save",
                     str(tmp_path / "decode.json")])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and json.loads((tmp_path / "decode.json").read_text()) == out
    for key in ("floor_ms", "copy_gbps", "device", "date", "versions"):
        assert key in out
    assert "CPU run" in out["model"]["config"]
    for system in ("warploop", "hf_eager"):
        assert all(out[system][k] > 0 for k in KEYS), out[system]
    assert out["warploop"]["check"]["rel_err_vs_fp32"] < 1e-4  # float32 on the CPU
    assert "skipped" in out["torch_compile"]
