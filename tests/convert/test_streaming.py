"""Streamed conversion: the writer's files are megatron's own, parallel workers change nothing, a checkpoint
whose chunks are TP shards exports exactly, a failure leaves nothing behind, and what the user sees."""

import hashlib

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from toolkit.cli import main as dsmt
from toolkit.convert.dcp_writer import TensorChunk, write_torch_dist
from toolkit.convert.mcore_reader import STACKED_EXPERTS, McoreReader
from toolkit.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Tiny GQA Llama, vocab 250 (padded to 256 in megatron), bf16 weights in two safetensors shards."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "llama", dtype=torch.bfloat16, max_shard_size="200KB")


def every_tensor(model_dir):
    """Canonical name -> tensor, read back through torch.distributed.checkpoint's reader (the reference path)."""
    reader = McoreReader(model_dir)
    names = []
    for key in reader.stored_keys():
        if key.startswith(EXPERTS):  # stacked over layers and experts
            layers, experts = reader.stacked_sizes(key, axes=2)
            names += [f"decoder.layers.{i}.mlp.experts.{e}.{key.removeprefix(EXPERTS)}"
                      for i in range(layers) for e in range(experts)]
        elif key.startswith("decoder.layers."):
            (layers,) = reader.stacked_sizes(key, axes=1)
            names += [key.replace("decoder.layers.", f"decoder.layers.{i}.") for i in range(layers)]
        else:
            names.append(key)
    return {name: _reference_read(reader, name) for name in names}


EXPERTS = "decoder.layers." + STACKED_EXPERTS


def _reference_read(reader, name):
    """The tensor from torch's reader, chunk by chunk (each chunk holds one stacked slice: layer, or layer and
    expert)."""
    key, index = reader.locate(name)
    stored, lead = reader._stored[key], len(index)
    chunks = [c for c in stored.chunks if tuple(c.offsets[:lead]) == index]
    whole = torch.empty(tuple(stored.size)[lead:], dtype=stored.properties.dtype)
    for chunk in chunks:
        part = reader._load_chunk(key, chunk)
        for _ in range(lead):
            part = part[0]
        target = whole
        for dim, start in enumerate(tuple(chunk.offsets)[lead:]):
            target = target.narrow(dim, start, part.shape[dim])
        target.copy_(part)
    return whole


def layout_of(model_dir):
    metadata = FileSystemReader(str(model_dir)).read_metadata()
    return {key: (tuple(md.size), md.properties.dtype, sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
            if hasattr(md, "chunks") else "bytes" for key, md in metadata.state_dict_metadata.items()}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """Tiny Mixtral and Qwen3-MoE (4 experts each, stacked by megatron over layers and experts), bf16."""
    root = tmp_path_factory.mktemp("hf-moe")
    return {model_type: make_tiny_checkpoint(root / model_type, model_type=model_type, dtype=torch.bfloat16, seed=11)
            for model_type in ("mixtral", "qwen3_moe")}


@pytest.fixture(params=["llama", "mixtral", "qwen3_moe"])
def hf_model(request, llama, moe_models):
    return llama if request.param == "llama" else moe_models[request.param]


def test_streamed_writer_matches_megatron_save_of_the_loaded_model(hf_model, tmp_path):
    """Reference: the model loaded into megatron-core layers in memory and saved by dist_checkpointing.save."""
    from megatron.core import parallel_state

    from toolkit.launch.local import single_process_group
    from toolkit.convert.chunks import load_model_chunks, save_mcore_checkpoint
    from toolkit.parallel.groups import Layout

    assert dsmt(["convert", "hf-to-mcore", str(hf_model), str(tmp_path / "streamed"), "--quiet"]) == 0
    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(1, 1)
        chunks, info = load_model_chunks(checkpoint=hf_model, layout=Layout(), attention="local")
        save_mcore_checkpoint(chunks=chunks, info=info, out_dir=tmp_path / "megatron", params_dtype=info.params_dtype)
    streamed, megatron = tmp_path / "streamed" / "model", tmp_path / "megatron" / "model"
    assert layout_of(streamed) == layout_of(megatron)
    mine, theirs = every_tensor(streamed), every_tensor(megatron)
    assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert (streamed / "metadata.json").read_text() == (megatron / "metadata.json").read_text()
    assert torch.load(streamed / "common.pt") == torch.load(megatron / "common.pt")
    assert (tmp_path / "streamed" / "dsmt_checkpoint.json").read_text() == \
        (tmp_path / "megatron" / "dsmt_checkpoint.json").read_text()


def sha256_files(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.safetensors"))}


def test_parallel_workers_write_the_same_checkpoints(hf_model, tmp_path):
    for workers in ("1", "3"):
        assert dsmt(["convert", "hf-to-mcore", str(hf_model), str(tmp_path / f"mcore{workers}"), "--quiet",
                     "--workers", workers]) == 0
        assert dsmt(["convert", "mcore-to-hf", str(tmp_path / f"mcore{workers}"), str(tmp_path / f"hf{workers}"),
                     "--quiet", "--workers", workers, "--max-shard-gb", "0.0002"]) == 0
    one, three = every_tensor(tmp_path / "mcore1" / "model"), every_tensor(tmp_path / "mcore3" / "model")
    assert all(torch.equal(one[k], three[k]) for k in one)
    assert len(sha256_files(tmp_path / "hf1")) > 1 and sha256_files(tmp_path / "hf1") == sha256_files(tmp_path / "hf3")
    assert sha256_files(tmp_path / "hf1") != sha256_files(hf_model)  # other shard sizes; the tensors are compared below
    from safetensors.torch import load_file

    original = {k: v for p in hf_model.glob("*.safetensors") for k, v in load_file(p).items()}
    exported = {k: v for p in (tmp_path / "hf3").glob("*.safetensors") for k, v in load_file(p).items()}
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) and original[k].dtype == exported[k].dtype for k in original)


def test_export_of_column_split_chunks_as_tensor_parallel_training_saves_them(llama, tmp_path):
    """Chunks that split each row (a ROW-parallel TP shard) cannot be read row by row: they are read whole."""
    import shutil

    assert dsmt(["convert", "hf-to-mcore", str(llama), str(tmp_path / "mcore"), "--quiet"]) == 0
    reader = McoreReader(tmp_path / "mcore" / "model")
    chunks = []
    for key in reader.stored_keys():
        stored = reader._stored[key]
        size = tuple(stored.size)
        for chunk in stored.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            tensor = reader._load_chunk(key, chunk)
            if len(sizes) >= 2 and sizes[-1] % 2 == 0:  # two column halves, as TP=2 of a RowParallelLinear
                half = sizes[-1] // 2
                for i in range(2):
                    part = tensor[..., i * half:(i + 1) * half].contiguous()
                    chunks.append(TensorChunk(key, size, (*offsets[:-1], i * half), (*sizes[:-1], half),
                                              part.dtype, make=lambda part=part: part))
            else:
                chunks.append(TensorChunk(key, size, offsets, sizes, tensor.dtype, make=lambda t=tensor: t))
    split = tmp_path / "split"
    shutil.copytree(tmp_path / "mcore", split, ignore=shutil.ignore_patterns("model"))
    write_torch_dist(model_dir=split / "model", tensors=chunks, objects=[], common={})
    assert any(offsets[-1] for offsets, _ in layout_of(split / "model")["decoder.layers.mlp.linear_fc2.weight"][2])
    assert dsmt(["convert", "mcore-to-hf", str(split), str(tmp_path / "back"), "--quiet"]) == 0
    from safetensors.torch import load_file

    original = {k: v for p in llama.glob("*.safetensors") for k, v in load_file(p).items()}
    exported = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(original) == sorted(exported) and all(torch.equal(original[k], exported[k]) for k in original)


def test_a_failure_midway_leaves_no_output(llama, tmp_path, monkeypatch, capsys):
    from toolkit.convert.raw_io import SafetensorsRows

    calls, read_rows = [0], SafetensorsRows.read_rows

    def failing(self, name, *, start, into):
        calls[0] += 1
        if calls[0] == 20:
            raise OSError("disk went away")
        return read_rows(self, name, start=start, into=into)

    monkeypatch.setattr(SafetensorsRows, "read_rows", failing)
    with pytest.raises(OSError, match="disk went away"):
        dsmt(["convert", "hf-to-mcore", str(llama), str(tmp_path / "out"), "--quiet"])
    assert calls[0] == 20 and list(tmp_path.iterdir()) == []


def test_progress_bar_summary_line_and_bad_workers(llama, tmp_path, capsys):
    assert dsmt(["convert", "hf-to-mcore", str(llama), str(tmp_path / "mcore")]) == 0
    captured = capsys.readouterr()
    assert "hf-to-mcore: 100%" in captured.err and "B/s" in captured.err  # tqdm's bar in bytes, with the rate
    line = captured.out.strip()
    assert line.startswith("dsmt convert hf-to-mcore: 39 tensors, ") and "(bfloat16)" in line and "GB/s" in line
    assert "peak memory" in line and str(tmp_path / "mcore") in line and "\n" not in line
    assert dsmt(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "hf"), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.startswith("dsmt convert mcore-to-hf: 39 tensors, ")
    with pytest.raises(SystemExit) as exit_info:
        dsmt(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "x"), "--workers", "0"])
    assert exit_info.value.code == 2 and "--workers must be a whole number >= 1, got '0'" in capsys.readouterr().err


def test_the_meta_build_touches_no_gpu_on_a_cuda_backend(llama, monkeypatch):
    """On a GPU node (backend "cuda": megatron's use_cpu_initialization=False) the layout-free model must still be
    built on the meta device: megatron would otherwise allocate every weight on the GPU. CUDA calls fail here."""
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.convert.hf_to_mcore import meta_sharded_state
    from toolkit.launch.local import single_process_group
    from toolkit.convert.chunks import inspect_checkpoint

    info = inspect_checkpoint(llama)
    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(1, 1)
        cuda = backends.Backend(name="cuda", dist_backend="gloo", use_transformer_engine=False)
        monkeypatch.setattr(backends, "current", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("asked for the CUDA device"))
        tensors, objects, common = meta_sharded_state(settings=info.settings, params_dtype=torch.bfloat16)
    assert tensors and all(t.data.device.type == "meta" for t in tensors) and common == {}
    assert {o.key.rsplit(".", 1)[-1] for o in objects} == {"_extra_state"}
