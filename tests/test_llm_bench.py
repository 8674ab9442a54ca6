"""`warploop bench decode` without a GPU: a small config, every contract key present."""
from __future__ import annotations

import json

import pytest

from warploop import cli

KEYS = ("ms_per_token_bs1", "tok_s_bs8", "tok_s_bs32", "ttft_ms_1024")


def test_bench_decode_on_cpu_prints_the_contract_keys(capsys, tmp_path):
    code = cli.main(["bench", "decode", "--json", "--steps", "2", "--repeats", "1", "--save",
                     str(tmp_path / "decode.json")])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and json.loads((tmp_path / "decode.json").read_text()) == out
    for key in ("models", "copy_gbps", "device", "date", "versions"):
        assert key in out
    (name, entry), = out["models"].items()
    assert name == "small-cpu" and "CPU run" in entry["model"]["config"] and entry["floor_ms"] > 0
    for system in ("warploop", "hf_eager"):
        assert all(entry[system][k] > 0 for k in KEYS), entry[system]
    check = entry["warploop"]["check"]
    assert check["rel_err_vs_fp32"] < 1e-4 and check["positions"] == 9    # float32 on the CPU: prefill + 8 steps
    assert entry["warploop"]["host_cpu_us_per_token_bs1"] > 0
    assert entry["warploop"]["ms_per_token_sampled_bs1"] > 0      # a temperature request's, beside greedy
    split = entry["warploop"]["ttft_split_ms_1024"]            # TTFT's parts: queue + prefill, then a step
    assert split["queue"] >= 0 and split["prefill"] > 0 and split["first_step"] > 0
    assert split["queue"] + split["prefill"] <= 1.5 * entry["warploop"]["ttft_ms_1024"]
    for system in ("warploop", "hf_eager"):         # TTFT's spread over its runs
        p10, p90 = entry[system]["ttft_p10_p90_ms_1024"]
        assert 0 < p10 <= entry[system]["ttft_ms_1024"] <= p90
    assert "skipped" in entry["torch_compile"] and "skipped" in entry["megakernel"] and "skipped" in entry["stream"]
    assert entry["ratios"]["floor_over_warploop_bs1"] > 0


def test_bench_decode_refuses_unknown_models_and_batches():
    import pytest

    with pytest.raises(SystemExit, match="unknown model llama-7b; choose from llama-3.2-1b"):
        cli.main(["bench", "decode", "--models", "llama-7b"])
    with pytest.raises(SystemExit, match="--batches '0,8'"):
        cli.main(["bench", "decode", "--batches", "0,8"])


def test_bench_prefill_on_cpu_prints_the_contract_keys(capsys, tmp_path):
    """`warploop bench prefill` without a GPU: prefill tok/s with p10/p90 per length, and the
    streams' inter-token gaps while a long prompt arrives, chunked and in one step."""
    code = cli.main(["bench", "prefill", "--json", "--runs", "2", "--lengths", "32,64", "--long", "160",
                     "--max-prefill-tokens", "32", "--streams", "2", "--save", str(tmp_path / "prefill.json")])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and json.loads((tmp_path / "prefill.json").read_text()) == out
    entry = out["models"]["small-cpu"]
    for n in ("32", "64"):
        assert {"ms", "p10_ms", "p90_ms", "tok_s", "runs"} <= set(entry["warploop"][n])
        assert entry["warploop"][n]["p10_ms"] <= entry["warploop"][n]["ms"] <= entry["warploop"][n]["p90_ms"]
        assert entry["warploop"][n]["new_length_ms"] > 0 and entry["warploop"][n]["new_thread_ms"] > 0
    assert entry["itl"]["chunked"]["prefill_chunks"] >= 4 and entry["itl"]["one_step"]["prefill_chunks"] == 0
    assert {"p50_ms", "p99_ms", "max_ms", "long_ttft_ms"} <= set(entry["itl"]["chunked"])
    # in one step the streams wait out the whole prefill: that gap is counted (it ends after the prompt's
    # first token), so the longest gap spans at least the prompt's time to its first token
    one = entry["itl"]["one_step"]
    assert one["long_tokens"] == 160 and one["max_ms"] >= one["long_ttft_ms"]
    with pytest.raises(SystemExit, match="--lengths"):
        cli.main(["bench", "prefill", "--lengths", "0"])


def test_bench_prefill_caps_the_long_prompt_at_the_models_context():
    """A --long past the model's positions (SmolLM2-135M has 8,192, the GPU default is 16,384) is capped
    at the model's own longest rather than refused by the engine."""
    import dataclasses

    import torch

    from warploop.bench.prefill import _itl
    from warploop.llm.shapes import CPU_MODELS

    cfg = dataclasses.replace(CPU_MODELS["small-cpu"][1], max_position_embeddings=160)
    out = _itl(cfg, torch.device("cpu"), torch.float32, 1, 100_000, 48, lambda _: None)
    assert out["chunked"]["long_tokens"] == out["one_step"]["long_tokens"] == 96
    assert out["chunked"]["prefill_chunks"] >= 2


def test_bench_prefill_alternates_the_attention_paths_and_restores_the_default():
    """prefix_L and fresh_L (GPU figures) run each attention (paged_prefill mode, SDPA backends) on the
    same batch, alternated after a warm-up of each, and leave the backend's own choice set (a fake
    backend records what it ran)."""
    import torch

    from warploop.bench.prefill import _fresh, _prefix
    from warploop.llm import layers

    class Fake:
        paged_prefill = "prefix"

        def __init__(self):
            self.ran = []

        def forward(self, batch):
            self.ran.append((self.paged_prefill, layers.SDPA_BACKENDS, tuple(batch.query_lens),
                             tuple(batch.context_lens)))

    fake, cpu, flash = Fake(), torch.device("cpu"), ("FLASH_ATTENTION", "EFFICIENT_ATTENTION")
    rec = _fresh(fake, list(range(40)), 3, cpu, lambda _: None)
    assert fake.ran == [("prefix", None, (40,), (40,)), ("prefix", flash, (40,), (40,)),
                        ("all", None, (40,), (40,))] * 4
    assert fake.paged_prefill == "prefix" and layers.SDPA_BACKENDS is None
    assert {"sdpa", "sdpa_flash", "paged", "paged_over_sdpa"} <= set(rec) and rec["sdpa"]["runs"] == 3
    fake.ran.clear()
    rec = _prefix(fake, list(range(40)), 2, cpu, lambda _: None)
    assert fake.ran[0] == ("prefix", None, (30,), (30,))       # the cached part, then the last quarter
    assert fake.ran[1:] == [("off", None, (10,), (40,)), ("prefix", None, (10,), (40,))] * 3
    assert fake.paged_prefill == "prefix" and rec["new_tokens"] == 10 and rec["context"] == 40


def test_bench_prefill_graphs_alternate_eager_and_graph_replays():
    """graphs_L runs the paged prefill op by op and through a PrefillGraphs of the prompt's length,
    alternated, and leaves the backend without graphs as it found it."""
    import torch

    from warploop.bench.prefill import _graphs
    from warploop.llm.cuda_graphs import PrefillGraphs

    class Fake:
        paged_prefill, prefill_graphs, device, max_blocks_per_seq = "prefix", None, torch.device("cpu"), 8

        def __init__(self):
            self.ran = []

        def forward(self, batch):
            graphs = self.prefill_graphs
            self.ran.append((self.paged_prefill, None if graphs is None else (type(graphs), graphs.max_tokens)))

    fake = Fake()
    rec = _graphs(fake, list(range(40)), 2, torch.device("cpu"), lambda _: None)
    graphed = ("all", (PrefillGraphs, 40))
    assert fake.ran == [graphed] + [("all", None), graphed] * 3     # the capture, then warm-ups and runs
    assert fake.prefill_graphs is None and fake.paged_prefill == "prefix"
    assert rec["eager"]["runs"] == rec["graphs"]["runs"] == 2 and rec["graphs_over_eager"] > 0
    assert rec["capture_ms"] >= 0


def test_sdpa_backends_choice_is_applied_on_a_gpu_only():
    """layers.SDPA_BACKENDS names torch's SDPA backends for prefill on a GPU; on the CPU it is ignored
    (torch's CPU SDPA has no flash kernel to pick), and an unknown name fails on a GPU."""
    import contextlib

    import torch

    from warploop.llm import layers

    before = layers.SDPA_BACKENDS
    try:
        layers.SDPA_BACKENDS = ("FLASH_ATTENTION",)
        assert isinstance(layers._sdpa_choice(torch.device("cpu")), contextlib.nullcontext)
        assert not isinstance(layers._sdpa_choice(torch.device("cuda", 0)), contextlib.nullcontext)
        layers.SDPA_BACKENDS = ("NO_SUCH_BACKEND",)
        with pytest.raises(AttributeError):
            layers._sdpa_choice(torch.device("cuda", 0))
    finally:
        layers.SDPA_BACKENDS = before


def test_transformers_peer_has_the_same_random_weights_every_run():
    """bench decode's check counts greedy tokens equal to transformers' on random weights (nearly
    flat logits, where one rounding flips a pick): the peer's weights are seeded, so runs compare."""
    pytest.importorskip("transformers")
    import dataclasses

    import torch

    from warploop.bench.decode_peers import hf_model
    from warploop.llm.shapes import GPU_MODELS
    cfg = dataclasses.replace(GPU_MODELS["smollm2-135m"][1], num_layers=1, vocab_size=512)
    a, b = hf_model(cfg, "cpu", torch.float32), hf_model(cfg, "cpu", torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_bench_decode_keeps_the_models_it_finished_when_a_later_one_fails(monkeypatch, tmp_path, capsys):
    """A run cut short (a later model's crash; a timeout the same way) leaves the finished models in
    the --save file, marked partial, instead of nothing."""
    from warploop.bench import decode

    def model(title, *args):
        if title == "second":
            raise RuntimeError("the second model's run broke")
        return {"model": title}

    monkeypatch.setattr(decode, "_parse_models", lambda text, gpu: {"one": ("first", None), "two": ("second", None)})
    monkeypatch.setattr(decode, "_bench_model", model)
    monkeypatch.setattr(decode, "_copy_gbps", lambda device: 1.0)
    save = tmp_path / "decode.json"
    assert cli.main(["bench", "decode", "--json", "--save", str(save)]) != 0
    assert "the second model's run broke" in capsys.readouterr().err
    got = json.loads(save.read_text())
    assert got["partial"] is True and list(got["models"]) == ["one"] and got["models"]["one"]["model"] == "first"
    assert not (tmp_path / "decode.json.tmp").exists()
