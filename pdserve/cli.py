"""`pdserve` command line. Bad input exits with status 2 and a message naming the problem."""
from __future__ import annotations

import argparse
import sys
import time


def _model_args(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--model", default=default,
                   help="preset name (demo: trained weights shipped with pdserve; tiny, "
                        "kimi-linear-48b-a3b, kimi-k3: seeded weights) or a model directory "
                        f"with config.json [+ *.safetensors] (default: {default})")
    p.add_argument("--seed", type=int, default=0, help="weight seed when no checkpoint (default 0)")


def _load(args):
    from pdserve.model.config import load_model_config, weights_dir
    from pdserve.model.generate import build_model

    config = load_model_config(args.model)
    ckpt = weights_dir(args.model)
    return config, build_model(config, seed=args.seed,
                               checkpoint=None if ckpt is None else str(ckpt))


def cmd_generate(args) -> int:
    from pdserve.api.tokenizer import ByteLevelTokenizer as ByteTokenizer
    from pdserve.cluster.demo import shown
    from pdserve.model.config import load_model_config
    from pdserve.model.generate import ReferenceEngine
    from pdserve.model.sampling import SamplingParams
    from pdserve.model.train_demo import PROMPTS

    t0 = time.perf_counter()
    if load_model_config(args.model).vocab_size != 256:
        raise ValueError(f"--model {args.model}: `generate` needs the byte-level vocabulary "
                         f"(demo, tiny); this model has a {load_model_config(args.model).vocab_size}-token "
                         "vocabulary and no tokenizer here")
    config, model = _load(args)
    tok = ByteTokenizer()
    prompts = args.prompt or list(PROMPTS[:2])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.sample_seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model}: {config.num_hidden_layers} layers "
          f"({len(config.kda_layer_ids)} KDA, {len(config.mla_layer_ids)} MLA), "
          f"{n_params / 1e6:.2f} M parameters, built in {time.perf_counter() - t0:.2f} s")
    engine = ReferenceEngine(model, num_pages=max(64, 4 * len(prompts)), num_slots=len(prompts) + 1)
    times = [time.perf_counter()]
    seqs = engine.generate([tok.encode(p) for p in prompts], params,
                           on_step=lambda _: times.append(time.perf_counter()))
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        print(f"\n{shown(i, p, tok.decode(s.output))}\n    [{len(s.output)} tokens, "
              f"{s.finish_reason}]")
    n_prompt = sum(len(tok.encode(p)) for p in prompts)
    steps = [b - a for a, b in zip(times[1:], times[2:])]
    print(f"\nprefill: {n_prompt} tokens in {(times[1] - times[0]) * 1e3:.1f} ms; "
          f"decode: {len(steps)} steps, "
          f"{(sum(steps) / max(len(steps), 1)) * 1e3:.2f} ms/step (batch {len(prompts)})")
    return 0


def cmd_export(args) -> int:
    from pdserve.model.weights import full_state, save_checkpoint

    config, model = _load(args)
    out = save_checkpoint(args.out, config, full_state(model, args.seed))
    print(f"wrote {out}/config.json and {out}/model.safetensors")
    return 0


def _serve_config(args):
    import msgspec

    from pdserve.cluster.config import describe, load_serve_config, validate

    cfg, model = load_serve_config(args.config)
    api = cfg.api
    if args.port is not None or args.host is not None:
        api = msgspec.structs.replace(api, port=api.port if args.port is None else args.port,
                                      host=api.host if args.host is None else args.host)
        cfg = msgspec.structs.replace(cfg, api=api)
        try:
            validate(cfg)
        except ValueError as exc:  # the overridden field is a flag here
            raise ValueError(str(exc).replace("api.port:", "--port (api.port):")
                             .replace("api.host:", "--host (api.host):")) from None
    print(describe(cfg, model), flush=True)
    return cfg, model


def _pool_capacity(cfg, context_tokens: int | None, output_tokens: int) -> str:
    """What the config's decode instance admits (`capacity.pool_capacity`); a request of the
    API's whole context unless `context_tokens` is given."""
    from pdserve.cluster.serve import max_context
    from pdserve.decode.capacity import format_pool, pool_capacity
    from pdserve.state.block_table import Topology

    d = cfg.decode
    topo = Topology(d.tp, d.dcp, d.interleave)
    if context_tokens is None:
        context_tokens, output_tokens = max_context(cfg) - output_tokens, output_tokens
    # a transfer stages conv state when the TPs or the conv layouts differ (planner.conv_staging)
    staging = not cfg.monolithic and (cfg.prefill.tp != d.tp
                                      or cfg.prefill.conv_layout != d.conv_layout)
    cap = pool_capacity(d.num_pages, d.num_slots, min(d.max_batch, d.num_slots - 1), topo,
                        cfg.state.page_tokens, context_tokens, output_tokens, staging)
    return format_pool(cap, topo)


def cmd_check(args) -> int:
    cfg, _ = _serve_config(args)
    print(_pool_capacity(cfg, args.context_tokens, args.output_tokens))
    print("config OK")
    return 0


def cmd_capacity(args) -> int:
    """`pdserve capacity`: a per-rank memory plan, or with --config what that config's decode
    instance admits."""
    from pdserve.decode.capacity import cmd_capacity as plan

    if args.config is None:
        return plan(args)
    from pdserve.cluster.config import load_serve_config

    cfg, _ = load_serve_config(args.config)
    print(_pool_capacity(cfg, args.context_tokens, args.output_tokens))
    return 0


def cmd_serve(args) -> int:
    import signal
    import threading

    import ray

    from pdserve.cluster.serve import running_server

    end = time.monotonic() + args.max_seconds if args.max_seconds else None
    cfg, model = _serve_config(args)
    stop = threading.Event()

    def catch_stop_signals():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    catch_stop_signals()
    with running_server(cfg, model, args.address, progress=lambda m: print(m, flush=True)) as (url, router):
        catch_stop_signals()     # ray.init() installed its own SIGTERM handler over ours
        print(f"pdserve: serving {cfg.model.name} at {url}/v1 (OpenAI API; /health, /metrics). "
              "Ctrl-C to stop.", flush=True)
        while not stop.wait(0.5):
            if end is not None and time.monotonic() > end:
                break
        print(f"pdserve: shutting down: new requests get 503; {router.in_flight} in flight get "
              f"up to {cfg.api.drain_s:g} s (api.drain_s) ...", flush=True)
        finished, ended = router.drain(cfg.api.drain_s)
    # the embedded Ray's processes stop with it (attached to a cluster: this driver leaves it)
    ray.shutdown()
    print(f"pdserve: stopped ({finished} request(s) finished in the drain, {ended} ended with "
          "an error event; every instance stopped)", flush=True)
    return 0


def cmd_demo(args) -> int:
    import socket

    from pdserve.cluster.demo import DEMO_CONFIG, run_demo

    if args.config is None:
        args.config = DEMO_CONFIG
    if args.port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    cfg, model = _serve_config(args)
    return run_demo(cfg, model, args.requests, args.max_tokens, args.address)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="monolithic reference generation (prefill + decode)")
    _model_args(g, "demo")
    g.add_argument("--prompt", action="append",
                   help="prompt text (repeat for a batch; default: two openings of the demo "
                        "model's training text)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=0, help="sampling seed (default 0)")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("export", help="write seeded weights as an HF-format checkpoint directory")
    _model_args(e, "tiny")
    e.add_argument("--out", required=True, help="output directory")
    e.set_defaults(func=cmd_export)

    for name, helptext, func in (
            ("serve", "start the cluster on Ray (disaggregated, or the config's monolithic mode) "
                      "and serve the OpenAI API", cmd_serve),
            ("demo", "start the default cluster, stream a few requests, print a summary, exit", cmd_demo),
            ("check", "validate a cluster config and print its topology and capacity", cmd_check)):
        c = sub.add_parser(name, help=helptext)
        c.add_argument("--config", default=None,
                       help="cluster TOML (default: cluster/configs/"
                            f"{'local-demo' if name == 'demo' else 'local-tiny'}.toml)")
        c.add_argument("--host", default=None, help="override api.host")
        c.add_argument("--port", type=int, default=None, help="override api.port")
        if name != "check":
            c.add_argument("--address", default=None,
                           help="Ray address to attach to (default: RAY_ADDRESS, else a local cluster)")
        if name == "serve":
            c.add_argument("--max-seconds", type=float, default=0,
                           help="stop after this many seconds (0 = until Ctrl-C)")
        if name == "demo":
            c.add_argument("--requests", type=int, default=4)
            c.add_argument("--max-tokens", type=int, default=64)
        if name == "check":
            c.add_argument("--context-tokens", type=int, default=None,
                           help="prompt tokens of the requests the admission figure counts "
                                "(default: the API's whole context, less --output-tokens)")
            c.add_argument("--output-tokens", type=int, default=0)
        c.set_defaults(func=func)

    from pdserve.bench import add_cli as add_bench
    from pdserve.decode.capacity import add_cli as add_capacity
    cap = add_capacity(sub)
    cap.add_argument("--config", default=None,
                     help="cluster TOML: what its decode instance's pools admit (decode.num_pages, "
                          "num_slots, max_batch, tp, dcp, interleave) instead of a memory plan")
    cap.set_defaults(func=cmd_capacity)
    add_bench(sub)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, KeyError, FileNotFoundError, NotImplementedError, MemoryError) as exc:
        # ConfigError is a ValueError: its message starts with the offending field
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
