"""Where the time of one speculative-decoding round goes, next to one plain decoding step, on
the static-cache decoder (CUDA graphs on GPU) and on the dynamic-cache path it replaced.

    python scripts/bench_decode.py [--context 256] [--reps 50] [--profile DIR] [dflash-train overrides ...]

Builds the target and a drafter of the configured `variant` from the composed config (random weights: timing does not
depend on them; the drafter runs in the target's dtype, as in dflash-eval), prefills
`--context` tokens, then times with CUDA events on GPU (wall clock on CPU), median over
`--reps` after warm-up:

  weights floor     the weight bytes a token's step reads (every weight; of a MoE's routed
                    experts only the top-k a token uses) / the measured device-copy
                    bandwidth: the least time a batch-1 decoding step can take
  plain step        one target forward of 1 token + the host read of its argmax (+ the
                    commit of its DeltaNet states, for a hybrid target)
  verify            one target forward of the block (B tokens; B + 1 after a DSpark block) +
                    drafter-context write
  plain: / verify:  a hybrid target's layers of one kind (Gated DeltaNet, attention) in the
                    plain step's and the verification's shapes, as one graph per kind
  draft             one drafter forward for a block over the cached context, then the variant's
                    greedy pick (DFlash's argmax, DSpark's Markov walk, DFlash2's selector walk)
  round             draft + verify + one host read + acceptance (+ the commit of the accepted
                    tokens' DeltaNet states), as dflash-eval runs it

Hybrid targets (Qwen3-Next, Qwen3.5 / 3.6: target=qwen3_5_9b_random) run the same decoder, their
Gated DeltaNet layers over per-slot states; their dynamic path re-runs the whole sequence.

A round costs `round / plain step` plain steps: DFlash is faster once tau exceeds that ratio.
Each variant's "x plain step" column divides by that variant's own plain step (compiled by
compiled, static by static).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def timer(device: torch.device):
    from dflash.tools.timing import median_ms

    def measure(fn, reps: int) -> float:
        return median_ms(fn, warmup=3, repeat=reps, device=device)

    return measure


def copy_bandwidth(device: torch.device, measure) -> float:
    """Bytes/s a device-to-device copy moves (read + write), the memory roofline we can reach."""
    source = torch.empty(1 << 28, dtype=torch.float32, device=device)  # 1 GiB
    target = torch.empty_like(source)
    ms = measure(lambda: target.copy_(source), 10)
    return 2 * source.numel() * 4 / (ms / 1000)


class PreparedDecoder:
    """A static decoder with `prompt` prefilled in both caches, and one round's inputs."""

    def __init__(self, target, drafter, prompt, *, graphs: bool | None, compile: bool):
        from dflash.decoding.engine import StaticDecoder

        block, committed, device = drafter.block_size, len(prompt), target.device
        self.decoder = decoder = StaticDecoder(
            target, drafter, max_len=committed + 4 * block, graphs=graphs, compile=compile
        )
        _, features = decoder._prefill(prompt)
        decoder.drafter_cache.write(features, torch.arange(committed, device=device).unsqueeze(0))
        # A round verifies [anchor, drafts]: B tokens after a DFlash or DFlash2 block, B + 1 after DSpark's.
        verify_len = decoder.verify_len
        self.kv_len = decoder.target_cache.kv_len_for(committed + verify_len)
        decoder._set(1, committed)
        self.block_ids = torch.ones((1, verify_len), dtype=torch.long, device=device)
        self.block_pos = committed + torch.arange(verify_len, device=device).unsqueeze(0)

    def verify(self, ids, positions, *, kv_len):
        """The target's forward of a block and the drafter-context write of its features."""
        logits, feats = self.decoder.target_cache.step(ids, positions, kv_len=kv_len)
        self.decoder.drafter_cache.write(feats, positions)
        return logits


def static_rows(target, drafter, prompt, measure, reps, compile):
    from dflash.decoding.graphs import GraphedFunction
    from dflash.decoding.reference import accepted_prefix

    block = drafter.block_size
    prepared = PreparedDecoder(target, drafter, prompt, graphs=None, compile=compile)
    decoder, kv_len = prepared.decoder, prepared.kv_len
    block_ids, block_pos = prepared.block_ids, prepared.block_pos

    def plain_step():
        decoder._plain_step(decoder._ids, decoder._pos, kv_len=kv_len).argmax(-1).tolist()
        decoder.keep(1)

    # With compile, the decoder's caches hold the compiled per-layer steps: these graphs replay them.
    verify_graph = GraphedFunction(prepared.verify, enabled=decoder.graphs_on)
    # The variant's own draft (greedy): DSpark's Markov walk, DFlash2's selector walk, DFlash's argmax.
    draft_graph = GraphedFunction(decoder.drafter_cache.round_draft, enabled=decoder.graphs_on)

    verified = prepared.block_ids.shape[1]
    verify_label = f"verify (B={block})" if verified == block else f"verify (B+1={verified})"

    def round_():
        drafts, logits = decoder._round(decoder._ids, decoder._pos, kv_len=kv_len)[:2]
        count = drafts.shape[0]
        both = torch.cat([drafts, logits.argmax(-1)]).tolist()
        accepted = accepted_prefix(both[:count], both[count:])
        decoder.keep(accepted + 1)

    plain_rows = layer_kind_rows(decoder, decoder._ids, decoder._pos, kv_len, measure, reps)
    verify_rows = layer_kind_rows(decoder, block_ids, block_pos, kv_len, measure, reps)
    return [
        ("plain step", measure(plain_step, reps)),
        *[(f"  plain: {label}", ms) for label, ms in plain_rows],
        (verify_label, measure(lambda: verify_graph(block_ids, block_pos, kv_len=kv_len), reps)),
        *[(f"  verify: {label}", ms) for label, ms in verify_rows],
        ("draft", measure(lambda: draft_graph(decoder._ids[0], decoder._pos[0], kv_len=kv_len), reps)),
        ("round", measure(round_, reps)),
    ]


def layer_kind_rows(decoder, ids, positions, kv_len, measure, reps):
    """The target step's layers of each kind (Gated DeltaNet, attention) run back to back on the
    step's inputs, as one graph per kind: where a step's time goes, layer kind by layer kind (the
    rest of the step is the embedding, the final norm and the LM head)."""
    from dflash.decoding.graphs import GraphedFunction

    cache = decoder.target_cache
    hidden, rope, mask = cache.step_inputs(ids, positions, kv_len=kv_len)
    rows = []
    for kind, deltanet in (("Gated DeltaNet", True), ("attention", False)):
        indices = [index for index, is_deltanet in enumerate(cache.deltanet) if is_deltanet == deltanet]
        if not indices or not any(cache.deltanet):  # a model of one kind: its step says it all
            continue

        def layers(hidden_in, indices=indices):
            for index in indices:
                hidden_in = cache.step_layer(index, hidden_in, rope=rope, mask=mask, positions_SQ=positions)
            return hidden_in

        graph = GraphedFunction(layers, enabled=decoder.graphs_on)
        rows.append((f"{len(indices)} {kind} layers", measure(lambda graph=graph: graph(hidden), reps)))
    return rows


def write_profiles(target, drafter, prompt, directory: Path) -> None:
    """Kernel tables of the plain step, the verification and the draft, run eagerly (a replayed
    graph's kernels are not listed one by one; their device times are the same)."""
    from dflash.tools.kernel_profile import write_kernel_table

    prepared = PreparedDecoder(target, drafter, prompt, graphs=False, compile=False)
    decoder, kv_len = prepared.decoder, prepared.kv_len
    steps = {
        "plain_step": lambda: decoder._plain_fn(decoder._ids, decoder._pos, kv_len=kv_len),
        "verify": lambda: prepared.verify(prepared.block_ids, prepared.block_pos, kv_len=kv_len),
        "draft": lambda: decoder.drafter_cache.draft(decoder._ids[0], decoder._pos[0], kv_len=kv_len),
    }
    for name, step in steps.items():
        step()
        write_kernel_table(step, directory / f"{name}.txt", repeats=10)
    print(f"kernel tables (10 eager calls each): {', '.join(str(directory / n) + '.txt' for n in steps)}")


def dynamic_rows(target, drafter, prompt, measure, reps):
    """The transformers path the static decoder replaced: eager, a forward per call over a
    cropped KV cache (a hybrid target's states cannot be cropped: it re-runs the sequence)."""
    from dflash.decoding.reference import DrafterContext, TargetSession, TokenChooser, accepted_prefix

    session, context = TargetSession(target), DrafterContext(drafter)
    _, features = session.run(prompt)
    context.extend(features)
    choose, committed = TokenChooser(0.0, target.device), len(session.ids)

    def plain_step():
        logits, _ = session.run([1])
        choose(logits)
        session.commit(committed)

    def round_():
        kv, length = context.kv, context.length
        guess = context.draft(target, 1)
        logits, new_features = session.run([1, *guess])
        accepted = accepted_prefix(guess, choose(logits))
        session.commit(committed + accepted + 1)
        context.extend(new_features[:, : accepted + 1])
        session.commit(committed)
        context.kv, context.length = kv, length

    return [("plain step", measure(plain_step, reps)), ("round", measure(round_, reps))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--skip-dynamic", action="store_true", help="only the static-cache decoder")
    parser.add_argument("--compile", action="store_true", help="also the torch.compile-fused static steps")
    parser.add_argument("--profile", help="a directory: kernel tables of the plain step, verify and draft")
    args, overrides = parser.parse_known_args()

    from dflash.config.devices import resolve_device_split
    from dflash.distributed import visible_cuda_devices
    from dflash.run.inputs import script_target
    from dflash.step.build import build_drafter, build_variant
    from dflash.tools.compose import compose_typed, device_default, with_defaults
    from dflash.tools.target_cost import token_weight_bytes

    defaults = ["paths.output_dir=/tmp/bench_decode", "paths.cache_dir=/tmp/bench_decode", device_default()]
    cfg = compose_typed(with_defaults(defaults, overrides))
    device = torch.device(resolve_device_split(cfg, visible_cuda_devices())[0][0])
    target, layer_ids = script_target(cfg, device, "bench_decode")  # a GGUF target.path: converted once
    target_config = target.config
    drafter = build_drafter(cfg.drafter, target_config, layer_ids, str(device), build_variant(cfg.variant))
    drafter = drafter.to(target.lm_head.weight.dtype).eval()
    measure = timer(device)
    prompt = torch.randint(0, cfg.drafter.mask_token_id, (args.context,)).tolist()
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    step_bytes = token_weight_bytes(target)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"\n{name}, {target_config.num_hidden_layers}-layer target ({weight_bytes / 2**30:.2f} GiB of weights), "
        f"{drafter.config.num_hidden_layers}-layer drafter, block {drafter.block_size}, context {args.context}, "
        f"{str(target.lm_head.weight.dtype)[6:]}"
    )
    floor_ms = None
    if device.type == "cuda":
        bandwidth = copy_bandwidth(device, measure)
        floor_ms = step_bytes / bandwidth * 1000
        print(
            f"weights floor {floor_ms:.3f} ms ({step_bytes / 2**30:.2f} GiB read per token step, "
            f"device copy bandwidth {bandwidth / 1e12:.2f} TB/s)"
        )
    graphs = "CUDA graphs" if device.type == "cuda" else "eager"
    print(f"{'part':<44}{'ms':>9}{'x plain step':>14}{'x floor':>9}")
    print(
        f"static: static cache, {graphs}; compiled: the same after torch.compile; dynamic: eager", flush=True
    )
    # Each variant's rows print as soon as they are measured: a time limit that strikes while
    # torch.compile works (minutes for an 8B target) keeps what was measured before.
    variants = [("static", lambda: static_rows(target, drafter, prompt, measure, args.reps, compile=False))]
    if args.compile:
        variants.append(
            ("compiled", lambda: static_rows(target, drafter, prompt, measure, args.reps, compile=True))
        )
    if not args.skip_dynamic:
        variants.append(("dynamic", lambda: dynamic_rows(target, drafter, prompt, measure, args.reps)))
    measured = {}
    for label, rows_of in variants:
        with torch.no_grad():
            rows = measured[label] = rows_of()
        # Each variant's rows in its own plain steps: a compiled round against the compiled plain
        # step, never against the uncompiled one (that ratio mixes two engines).
        plain = rows[0][1]
        for part, ms in rows:
            floor = f"{ms / floor_ms:>9.2f}" if floor_ms else f"{'-':>9}"
            print(f"{part + ' [' + label + ']':<44}{ms:>9.3f}{ms / plain:>14.2f}{floor}", flush=True)
    if args.profile:
        with torch.no_grad():
            write_profiles(target, drafter, prompt, Path(args.profile))
    static, fused, dynamic = (measured.get(label, []) for label in ("static", "compiled", "dynamic"))
    print(f"static: DFlash is faster than plain decoding once tau > {static[-1][1] / static[0][1]:.2f}")
    if fused:
        print(f"compiled: tau > {fused[-1][1] / fused[0][1]:.2f}")
    if dynamic:
        print(
            f"dynamic: tau > {dynamic[-1][1] / dynamic[0][1]:.2f}; static plain step "
            f"{dynamic[0][1] / static[0][1]:.1f}x faster, round {dynamic[-1][1] / static[-1][1]:.1f}x faster"
        )


if __name__ == "__main__":
    main()
