"""run_together begins its calls once every call's thread is up: calls that begin
together join each first layer's fetch (a call begun after the others passed its
first layers would fetch them again and hold the others back)."""
import threading

import torch
from torch import nn

import layerwise


class Stack(nn.Module):
    def __init__(self, layers=4, d=16):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(d, d) for _ in range(layers)])

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def test_every_call_begins_after_every_thread_is_up():
    torch.manual_seed(0)
    model = Stack()
    ref = Stack()
    ref.load_state_dict(model.state_dict())
    layerwise.configure_layerwise_offload(model, "blocks", device="cpu")
    k_calls = 6
    xs = [torch.randn(1 + k, 16) for k in range(k_calls)]
    seen = [None] * k_calls

    def call(k):
        def fn(m):
            # the threads of this run_together that have started when call k begins
            seen[k] = sum(t.name.startswith("layerwise-call-") for t in threading.enumerate())
            with torch.no_grad():
                return m(xs[k])
        return fn

    outs = layerwise.run_together(model, [call(k) for k in range(k_calls)])
    assert seen == [k_calls] * k_calls
    with torch.no_grad():
        assert all(torch.equal(o, ref(x)) for o, x in zip(outs, xs))
