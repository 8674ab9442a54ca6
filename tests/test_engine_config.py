"""The engine's settings are one typed record (EngineConfig), checked before anything loads: each
bad value is refused naming its flag, an unknown option lists the known ones, and a config and
keyword options are not mixed."""
import pytest

from warploop.llm.engine import Engine, SamplingParams
from warploop.llm.engine_config import EngineConfig


@pytest.mark.parametrize("options, message", [
    (dict(max_num_seqs=0), "--max-num-seqs"),
    (dict(max_batch_tokens=-5), "--max-batch-tokens"),
    (dict(max_prefill_tokens=1.5), "--max-prefill-tokens"),
    (dict(block_size=True), "--block-size"),
    (dict(num_kv_blocks=0), "--num-kv-blocks"),
    (dict(max_model_len=-1), "--max-model-len"),
    (dict(tensor_parallel=0), "--tensor-parallel"),
    (dict(dtype="float8"), "--dtype"),
    (dict(backend="mega"), "is not one of torch, megakernel, stream"),
    (dict(backend="megakernel", tensor_parallel=2), "--tensor-parallel"),
    (dict(enable_prefix_caching="yes"), "--no-prefix-caching"),
    (dict(max_num_sequences=4), "unknown engine option max_num_sequences; the options are"),
])
def test_bad_settings_are_refused_by_name_before_loading(options, message):
    with pytest.raises(ValueError, match=message):
        Engine.from_model("no/such/model", **options)      # the config fails first, not the path


def test_a_config_runs_an_engine_and_is_not_mixed_with_options():
    config = EngineConfig(device="cpu", max_num_seqs=2, num_kv_blocks=32, max_prefill_tokens=2, progress=False)
    assert EngineConfig.from_options(config.options()) == config
    with Engine.from_model("tiny", config=config) as engine:
        out = engine.generate("def main(", SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out.token_ids) == 3 and engine.stats()["prefill_chunks"] >= 1
    with pytest.raises(ValueError, match="not both"):
        Engine.from_model("tiny", config=config, device="cpu")
