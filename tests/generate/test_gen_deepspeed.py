"""DeepSpeed's own parser accepts every generated ds_config.json at the spec's data-parallel size."""

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gen_helpers import VARIANTS, render, spec_of
from toolkit.generate.deepspeed_config import build_deepspeed_config
from toolkit.check.checks import run_checks
from toolkit.spec.layout import derive_layout
from toolkit.spec.load import validate_spec

deepspeed_config = pytest.importorskip("deepspeed.runtime.config")


class FakeMpu:
    """The getters DeepSpeedConfig (and engine set-up) ask a model-parallel unit for; no process group needed."""

    def __init__(self, *, dp: int, tp: int, pp: int):
        self.dp, self.tp, self.pp = dp, tp, pp

    def get_data_parallel_world_size(self): return self.dp
    def get_data_parallel_rank(self): return 0
    def get_model_parallel_world_size(self): return self.tp * self.pp
    def get_model_parallel_rank(self): return 0
    def get_tensor_model_parallel_world_size(self): return self.tp
    def get_tensor_model_parallel_rank(self): return 0
    def get_pipeline_model_parallel_world_size(self): return self.pp
    def get_pipeline_model_parallel_rank(self): return 0


class RecordingDict(dict):
    """Records which top-level keys DeepSpeed looks at while parsing."""

    def __init__(self, *args, seen: set, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = seen

    def __copy__(self):
        return RecordingDict(self, seen=self.seen)

    def get(self, key, *default):
        self.seen.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)


@pytest.fixture(autouse=True)
def rank_without_process_group(monkeypatch):
    # DeepSpeedConfig reads the mpu only when dist.get_rank() works; otherwise it silently assumes world size 1.
    monkeypatch.setattr(deepspeed_config.dist, "get_rank", lambda *a, **k: 0)


def parse(config: dict, *, dp: int, tp: int = 1, pp: int = 1, seen: set | None = None):
    payload = RecordingDict(config, seen=seen if seen is not None else set())
    return deepspeed_config.DeepSpeedConfig(payload, mpu=FakeMpu(dp=dp, tp=tp, pp=pp))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_deepspeed_accepts_generated_config(name):
    spec, files = spec_of(name), render(name)
    layout = derive_layout(spec)
    parsed = parse(json.loads(files["ds_config.json"]), dp=layout.dp, tp=layout.tp, pp=layout.pp)
    assert parsed.world_size == layout.dp
    assert (parsed.train_batch_size, parsed.gradient_accumulation_steps) == (layout.global_batch_size,
                                                                             layout.grad_accum_steps)
    assert parsed.zero_optimization_stage == spec.parallel.zero_stage


def test_the_mpu_path_is_really_checked():
    config = build_deepspeed_config(spec=spec_of("tiny-cpu"), layout=derive_layout(spec_of("tiny-cpu")))
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        parse(config, dp=4)  # generated for dp=2


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_top_level_key_is_one_deepspeed_reads(name):
    """DeepSpeed silently ignores unknown top-level keys; ours must all be keys it actually reads."""
    spec = spec_of(name)
    layout = derive_layout(spec)
    config, seen = json.loads(render(name)["ds_config.json"]), set()
    parse(config, dp=layout.dp, tp=layout.tp, pp=layout.pp, seen=seen)
    assert set(config) - seen == set()


@st.composite
def valid_specs(draw):
    nodes = draw(st.sampled_from([1, 2, 4]))
    gpus = draw(st.sampled_from([1, 2, 4, 8]))
    world = nodes * gpus
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if world % t == 0]))
    pp = draw(st.sampled_from([p for p in (1, 2, 4) if world % (tp * p) == 0]))
    dp = world // (tp * pp)
    zero = draw(st.sampled_from([0, 1] if pp > 1 else [0, 1, 2, 3]))
    micro, accum = draw(st.integers(1, 4)), draw(st.integers(1, 16))
    precision = draw(st.sampled_from(["bf16", "fp16", "fp32"]))
    seq = draw(st.sampled_from([128, 512, 2048]))
    use_tokens = draw(st.booleans())
    batch = {"global_batch_tokens": micro * accum * dp * seq} if use_tokens else {"global_batch_size": micro * accum * dp}
    hosts = None if nodes == 1 else draw(st.sampled_from(["slurm", [f"node{i}" for i in range(nodes)]]))
    raw = {
        "model": {"config": {"hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 8,
                             "num_key_value_heads": draw(st.sampled_from([1, 2, 8])), "intermediate_size": 512,
                             "vocab_size": draw(st.integers(100, 5000)), "max_position_embeddings": 4096}},
        "cluster": {"nodes": nodes, "gpus_per_node": gpus, "hosts": hosts,
                    "interconnect": draw(st.sampled_from(["infiniband", "roce", "tcp"])),
                    "launcher": draw(st.sampled_from(["pdsh", "openmpi", "no_ssh"]))},
        "parallel": {"tp": tp, "pp": pp, "zero_stage": zero, "sequence_parallel": tp > 1 and draw(st.booleans()),
                     "offload_optimizer": zero > 0 and draw(st.booleans()),
                     "offload_params": zero == 3 and draw(st.booleans())},
        "training": {**batch, "micro_batch_size": micro, "seq_length": seq, "precision": precision,
                     "recompute": draw(st.sampled_from(["none", "selective", "full"])),
                     "lr_schedule": draw(st.sampled_from(["cosine", "linear", "constant"])),
                     "warmup_steps": draw(st.integers(0, 50)), "grad_clip": draw(st.sampled_from([0.0, 1.0]))},
        "communication": {"overlap_comm": draw(st.booleans()), "reduce_bucket_elements": draw(st.integers(1, 10**9))},
        "data": {"synthetic": True},
    }
    return raw, dp


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_specs())
def test_deepspeed_accepts_random_valid_specs(case):
    raw, dp = case
    spec = validate_spec(raw, source="hypothesis")
    assume(run_checks(spec=spec).ok)
    layout = derive_layout(spec)
    assert layout.dp == dp
    config = build_deepspeed_config(spec=spec, layout=layout)
    seen: set = set()
    parsed = parse(json.loads(json.dumps(config)), dp=dp, tp=layout.tp, pp=layout.pp, seen=seen)
    assert parsed.train_batch_size == parsed.train_micro_batch_size_per_gpu * parsed.gradient_accumulation_steps * dp
    assert set(config) <= seen


def test_key_recording_catches_an_unknown_top_level_key():
    spec = spec_of("tiny-cpu")
    config, seen = {**build_deepspeed_config(spec=spec, layout=derive_layout(spec)), "zero_optimisation": {}}, set()
    parse(config, dp=2, seen=seen)  # DeepSpeed itself accepts it silently
    assert set(config) - seen == {"zero_optimisation"}
