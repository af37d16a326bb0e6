"""The GPU's batch copy (toolkit/backend/copies.py), which no CPU run takes: torch.cuda's streams and the tensors'
pinning are replaced by recorders, and the copy must pin every host tensor, copy it non-blocking on the side
stream, make the compute stream wait for that stream, and mark each copy as used by the compute stream."""

import contextlib

import torch

from toolkit.backend import copies


class Stream:
    def __init__(self, name: str, events: list):
        self.name, self.events = name, events

    def wait_stream(self, other) -> None:
        self.events.append(("wait", self.name, other.name))


def recorded_copy(monkeypatch, batches: list[dict], *, pinned: set[int] = frozenset()):
    events: list[tuple] = []
    compute, side = Stream("compute", events), Stream("side", events)
    current = {"stream": compute}

    @contextlib.contextmanager
    def use(stream):
        events.append(("enter", stream.name))
        current["stream"] = stream
        yield
        current["stream"] = compute
        events.append(("exit", stream.name))

    def pin_memory(tensor):
        events.append(("pin", id(tensor)))
        return tensor.clone()  # a new (pinned) host tensor

    def to(tensor, device, non_blocking=False):
        copy = tensor.to("meta")  # stands for the device copy; its storage is not read
        events.append(("copy", current["stream"].name, non_blocking, id(copy)))
        return copy

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(copies, "_side_stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: id(self) in pinned)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(copies, "_to_device", to)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: events.append(("record", id(self), s.name)))
    return copies.copy_to_cuda(batches, device=torch.device("cuda", 0)), events


def test_host_tensors_are_pinned_and_copied_on_the_side_stream_the_compute_stream_waits_for(monkeypatch):
    tokens, labels, on_device = torch.arange(6).view(2, 3), torch.ones(2, 3), torch.zeros(2).to("meta")
    already_pinned = torch.ones(3)
    moved, events = recorded_copy(monkeypatch, [{"tokens": tokens, "labels": labels, "kept": on_device,
                                                 "note": "not a tensor"}, {"mask": already_pinned}],
                                  pinned={id(already_pinned)})
    copied = [e for e in events if e[0] == "copy"]
    assert [e[1:3] for e in copied] == [("side", True)] * 3  # tokens, labels, mask: each non-blocking, on the side
    assert [e for e in events if e[0] == "pin"] == [("pin", id(tokens)), ("pin", id(labels))]  # not the pinned one
    enter, exit_, wait = events.index(("enter", "side")), events.index(("exit", "side")), events.index(
        ("wait", "compute", "side"))
    assert enter < events.index(copied[0]) and events.index(copied[-1]) < exit_ < wait
    records = [e for e in events if e[0] == "record"]
    assert records == [("record", e[3], "compute") for e in copied] and events.index(records[0]) > wait
    assert moved[0]["kept"] is on_device and moved[0]["note"] == "not a tensor"  # passed through as they are
    assert moved[0]["tokens"].device.type == "meta" and moved[1]["mask"].shape == (3,)


def test_the_cpu_backend_moves_nothing():
    from toolkit import backend as backends

    batch = {"tokens": torch.arange(4)}
    (moved,) = backends.current().to_device([batch])
    assert moved is not batch and moved["tokens"] is batch["tokens"]
