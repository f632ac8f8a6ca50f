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

from dflash.models.compile import compile_shared


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
    outcome: dict[str, object] = {}

    def other_thread():
        try:
            inside_trace.wait(timeout=120)
            outcome["value"] = steady(torch.ones(2)).tolist()
            outcome["ran_after_the_compile"] = compile_done.is_set()
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            outcome["error"] = error
        finally:
            other_called.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    assert compiling(torch.ones(3)).tolist() == [0.0, 0.0, 0.0]
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert outcome == {"value": [2.0, 2.0], "ran_after_the_compile": True}


def test_every_compiled_function_of_the_package_goes_through_the_shared_lock():
    package = pathlib.Path(__file__).resolve().parent.parent / "dflash"
    direct = []
    for path in package.rglob("*.py"):
        if path.name == "compile.py" and path.parent.name == "models":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.compile":
                direct.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    assert not direct, f"use dflash.models.compile.compile_shared, not torch.compile: {direct}"


def test_a_graph_compiled_after_the_first_training_step_is_warned_about(caplog):
    """Before `settle` graphs are the run's start-up; after it a new graph means the pipeline
    stood still while it compiled: a warning that names the role and points at the replay."""
    from dflash.models.compile import CompileCounter

    counter = CompileCounter("drafter", backend=lambda graph_module, example_inputs: graph_module.forward)
    double = compile_shared(lambda x: x * 2, backend=counter, dynamic=True)
    with caplog.at_level("INFO", logger="dflash.models.compile"):
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
    global while one is: torch >= 2.12 holds `torch.compiler.is_compiling()` true in every thread
    for the whole compile. So a target thread running transformers' eager forward while the
    drafter compiles rewrites that global under the drafter's trace: a drafter graph that read
    it would recompile on every change, or fail building its guards ("'NoneType' object is not
    subscriptable", seen on a 2-core CPU with four compile threads). The drafter computes its own
    rotary embedding and reads none of it."""
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

    from dflash.models.target import FrozenTarget

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
    outcome: list[dict[str, object]] = [{}, {}]

    def run(index: int):
        try:
            with torch.no_grad():
                outcome[index]["features"] = targets[index].features(ids[index])
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            outcome[index]["error"] = error
        finally:
            inside[index].set()
            done[index].set()

    if compile_opens == "before_both":
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    threads = [threading.Thread(target=run, args=(index,)) for index in (0, 1)]
    threads[0].start()
    assert inside[0].wait(timeout=300)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # what another thread's compile sets
    threads[1].start()
    for thread in threads:
        thread.join(timeout=300)
    for index in (0, 1):
        assert "error" not in outcome[index], f"thread {index}: {outcome[index].get('error')!r}"
        torch.testing.assert_close(outcome[index]["features"], want[index], rtol=0, atol=0)


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
    inside, release = threading.Event(), threading.Event()

    def hold(module, args, output):
        inside.set()
        assert release.wait(timeout=300)

    first_attention_projection(eager).register_forward_hook(hold)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # another thread's compile session
    outcome: dict[str, object] = {}

    def eager_forward():
        try:
            with torch.no_grad():
                eager.model(input_ids=ids, use_cache=False)
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            outcome["error"] = error
        finally:
            inside.set()

    thread = threading.Thread(target=eager_forward)
    thread.start()
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


def test_a_record_of_another_layout_is_left_as_the_library_wrote_it(monkeypatch, caplog):
    """A later transformers or `kernels` whose record has other fields keeps its own class (the
    per-thread methods read `context_var`, `global_var` and the flag field), with a warning."""
    import sys
    import types

    from dflash.models import thread_records

    class Record:
        def __init__(self):
            self.context_var, self.global_var, self.in_trace = None, None, False

    library = types.ModuleType("later_library")
    library.record = Record()
    monkeypatch.setitem(sys.modules, "later_library", library)
    location = ("later_library", "record", ("context_var", "global_var", "compiling"))
    with caplog.at_level("WARNING", logger="dflash.models.thread_records"):
        thread_records._replace(location, thread_records._collector_class)
    assert type(library.record) is Record
    assert "later_library.record has fields" in caplog.text
    library.record.compiling = False
    thread_records._replace(location, thread_records._collector_class)
    assert type(library.record).__name__ == "PerThreadCollector"
