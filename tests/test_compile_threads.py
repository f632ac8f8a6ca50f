"""Compiled code called from several threads (the asynchronous pipeline): a thread that enters a
compiled function while another thread compiles waits for the compile to end. Not waiting
fails in torch 2.11 ("Detected that you are using FX to symbolically trace a dynamo-optimized
function": the FX-tracing flag a compile sets is process-wide) and, in later versions, makes
`torch.compiler.is_compiling()` true in the other thread too (the drafter would then take eager
flex_attention)."""

from __future__ import annotations

import ast
import pathlib
import threading

import pytest
import torch
from torch import nn

from dflash.torch_runtime.compile import compile_shared


def start_thread(
    work, *, then: tuple[threading.Event, ...] = ()
) -> tuple[threading.Thread, dict[str, object]]:
    """`work()` in a thread of its own, started: its outcome dict gets "value" (what work
    returned) or "error" (what it raised), and the events in `then` are set once it has ended,
    either way, so that no other thread waits for it in vain."""
    outcome: dict[str, object] = {}

    def body():
        try:
            outcome["value"] = work()
        except BaseException as error:  # noqa: BLE001 - reported by the caller's assertions
            outcome["error"] = error
        finally:
            for event in then:
                event.set()

    thread = threading.Thread(target=body)
    thread.start()
    return thread, outcome


def test_a_thread_entering_compiled_code_while_another_compiles_waits_for_the_compile():
    inside_trace, other_called, compile_done = threading.Event(), threading.Event(), threading.Event()

    class Probe(nn.Module):
        def forward(self, x):
            inside_trace.set()  # torch's process-wide "FX tracing" flag is set from here on
            other_called.wait(timeout=3)  # the other thread's chance to run compiled code now
            return x + 1

    def tracing_backend(graph_module, example_inputs):
        torch.fx.symbolic_trace(Probe())  # as AOTAutograd traces a graph while compiling
        compile_done.set()
        return graph_module.forward

    steady = compile_shared(lambda x: x * 2, backend="eager")
    assert steady(torch.ones(2)).tolist() == [2.0, 2.0]  # compiled before the threads start
    compiling = compile_shared(lambda x: x - 1, backend=tracing_backend)

    def other_thread():
        inside_trace.wait(timeout=120)
        return steady(torch.ones(2)).tolist(), compile_done.is_set()

    thread, outcome = start_thread(other_thread, then=(other_called,))
    assert compiling(torch.ones(3)).tolist() == [0.0, 0.0, 0.0]
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["value"] == ([2.0, 2.0], True)  # the value, and it ran after the compile


def test_every_compiled_function_of_the_package_goes_through_the_shared_lock():
    package = pathlib.Path(__file__).resolve().parent.parent / "dflash"
    direct = []
    for path in package.rglob("*.py"):
        if path.name == "compile.py" and path.parent.name == "torch_runtime":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.compile":
                direct.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    assert not direct, f"use dflash.torch_runtime.compile.compile_shared, not torch.compile: {direct}"


def test_a_graph_compiled_after_the_first_training_step_is_warned_about(caplog):
    """Before `settle` graphs are the run's start-up; after it a new graph means the pipeline
    stood still while it compiled: a warning that names the role and points at the replay."""
    from dflash.torch_runtime.compile import CompileCounter

    counter = CompileCounter("drafter", backend=lambda graph_module, example_inputs: graph_module.forward)
    double = compile_shared(lambda x: x * 2, backend=counter, dynamic=True)
    with caplog.at_level("INFO", logger="dflash.torch_runtime.compile"):
        double(torch.ones(3, 4))
        double(torch.ones(5, 4))  # symbolic shapes: no new graph
        counter.settle()
        double(torch.ones(7, 4))
        assert counter.graphs == 1 and not [r for r in caplog.records if r.levelname == "WARNING"]
        double(torch.ones(1, 4))  # a size of 1 is specialised: a new graph, mid-run
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert counter.graphs == 2
    assert len(warnings) == 1 and "drafter: compiling graph 2 mid-run" in warnings[0]
    assert "scripts/replay_compiles.py" in warnings[0]


def test_the_compiled_drafter_holds_no_guard_on_state_transformers_shares_between_threads(monkeypatch):
    """transformers >= 5.2x runs its attention forwards through the `kernels` hub, whose active-
    kernel record is a context variable until a compile session is open, and a process-wide
    global while one is: torch 2.13 holds `torch.compiler.is_compiling()` true in every thread
    for the whole compile (pytorch/pytorch#184614). So a target thread running transformers'
    eager forward while the drafter compiled rewrote that global under the drafter's trace
    (until dflash/torch_runtime/thread_records.py kept eager threads off it): a drafter graph that read
    it recompiled on every change, or failed building its guards ("'NoneType' object is not
    subscriptable", seen on a 2-core CPU with four compile threads). The drafter computes its own
    rotary embedding and reads none of it, whatever sets the record."""
    kernels_layer = pytest.importorskip("kernels._internals.layer.layer")
    from tests.test_dflash_rules import tiny_target
    from tests.test_drafter_compile import drafter_of_depth, forward_backward

    torch._dynamo.reset()
    target = tiny_target()
    ids = torch.randint(0, 500, (1, 20))
    drafter = drafter_of_depth(target, 2, "dflash")
    drafter.compile_training("eager")
    want, _ = forward_backward(drafter, target, ids)
    drafter.zero_grad()
    # What transformers' attention forward leaves there while it runs in another thread.
    record = kernels_layer._ACTIVE_KERNEL_FUNCS
    monkeypatch.setattr(record, "uses_global_var", True)
    monkeypatch.setattr(record, "global_var", {id(record): (None, None)})
    with torch.compiler.set_stance("fail_on_recompile"):
        got, _ = forward_backward(drafter, target, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def first_attention_projection(target) -> nn.Module:
    """The q projection of the target's first attention layer: a hook there runs inside an
    attention forward, with the records of its model and layer set."""
    return next(module for name, module in target.model.named_modules() if name.endswith("self_attn.q_proj"))


def tiny_family_target(family: str, request):
    from transformers import AutoModelForCausalLM

    from dflash.target.model import FrozenTarget

    return FrozenTarget(
        AutoModelForCausalLM.from_pretrained(request.getfixturevalue(f"tiny_{family}_dir")), [1, 3]
    )


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
@pytest.mark.parametrize("compile_opens", ["before_both", "between_the_two"])
def test_two_threads_running_targets_while_another_thread_compiles_each_get_their_own_features(
    monkeypatch, request, compile_opens, family
):
    """torch 2.13 holds `torch.compiler.is_compiling()` true in every thread for a whole compile
    session (pytorch/pytorch#184614), which transformers' output collector and `kernels`' kernel
    table read as "this code is being traced": they then keep one attribute for all threads.
    Two target threads (several target GPUs, or a target and an evaluation) met there while the
    drafter compiled: one thread's hidden states went to the other's collector or were lost,
    and `kernels` read a context token as its table. Here both forwards are held inside their
    first attention, records set, and finish one after the other; each must get its own
    features. `compile_opens`: the session opens before both forwards start, or between them
    (the first's records set in eager mode, the second's under the flag); `family`: a dense
    target and a hybrid MoE one."""
    targets = [tiny_family_target(family, request), tiny_family_target(family, request)]
    ids = [torch.randint(0, 500, (2, 20), generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    with torch.no_grad():
        want = [target.features(x) for target, x in zip(targets, ids)]
    inside, done = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]

    def hold(index: int, until: threading.Event):
        def hook(module, args, output):
            if not inside[index].is_set():  # the first call only: the forward's first attention
                inside[index].set()
                assert until.wait(timeout=300)

        return hook

    # The first forward waits inside until the second is inside too; the second until the first is done.
    first_attention_projection(targets[0]).register_forward_hook(hold(0, inside[1]))
    first_attention_projection(targets[1]).register_forward_hook(hold(1, done[0]))

    def features(index: int):
        with torch.no_grad():
            return targets[index].features(ids[index])

    if compile_opens == "before_both":
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    first, first_outcome = start_thread(lambda: features(0), then=(inside[0], done[0]))
    assert inside[0].wait(timeout=300)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # what another thread's compile sets
    second, second_outcome = start_thread(lambda: features(1), then=(inside[1], done[1]))
    for thread in (first, second):
        thread.join(timeout=300)
    outcome = [first_outcome, second_outcome]
    for index in (0, 1):
        assert "error" not in outcome[index], f"thread {index}: {outcome[index].get('error')!r}"
        torch.testing.assert_close(outcome[index]["value"], want[index], rtol=0, atol=0)


def test_a_compiled_target_does_not_recompile_while_an_eager_forward_in_another_thread_holds_its_records(
    monkeypatch,
):
    """The target's compiled layers read `kernels`' active-function table as traced code does (the
    shared attribute). An eager forward of a target in another thread (an evaluation decoding
    with transformers' cache) wrote that attribute while any thread compiled, and the compiled
    layers' guards on it then failed: a recompile per change. With the records per thread, an
    eager forward keeps its own, and the compiled layers run their graphs as built."""
    from tests.test_dflash_rules import tiny_target

    torch._dynamo.reset()
    compiled, eager = tiny_target(), tiny_target()
    compiled.compile_features(backend="eager", scope="layers")
    ids = torch.randint(0, 500, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = compiled.features(ids)
        want_logits = eager.model(input_ids=ids, use_cache=False).logits
    inside, release = threading.Event(), threading.Event()

    def hold(module, args, output):
        inside.set()
        assert release.wait(timeout=300)

    first_attention_projection(eager).register_forward_hook(hold)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # another thread's compile session

    def eager_forward():
        with torch.no_grad():
            return eager.model(input_ids=ids, use_cache=False).logits

    thread, outcome = start_thread(eager_forward, then=(inside,))
    try:
        assert inside.wait(timeout=300)
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", False)  # that compile has ended
        with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
            got = compiled.features(ids)
    finally:
        release.set()
        thread.join(timeout=300)
    assert "error" not in outcome, outcome.get("error")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(outcome["value"], want_logits, rtol=0, atol=0)


def test_a_record_of_another_layout_is_left_as_the_library_wrote_it(monkeypatch, caplog):
    """A later transformers or `kernels` whose record has other fields keeps its own class (the
    per-thread methods read `context_var`, `global_var` and the flag field), with a warning."""
    import sys
    import types

    from dflash.torch_runtime import thread_records

    class Record:
        def __init__(self):
            self.context_var, self.global_var, self.in_trace = None, None, False

    library = types.ModuleType("later_library")
    library.record = Record()
    monkeypatch.setitem(sys.modules, "later_library", library)
    location = ("later_library", "record", ("context_var", "global_var", "compiling"))
    with caplog.at_level("WARNING", logger="dflash.torch_runtime.thread_records"):
        thread_records._replace(location, thread_records._collector_class)
    assert type(library.record) is Record
    assert "later_library.record has fields" in caplog.text
    library.record.compiling = False
    thread_records._replace(location, thread_records._collector_class)
    assert type(library.record).__name__ == "PerThreadCollector"
