"""/metrics: the engine's state and counters in Prometheus' text format (names after vLLM's,
prefixed `mtpkit_`). Read without the engine lock: each value is one read of a Python int."""


def _line(out: list, name: str, kind: str, help: str, samples) -> None:
    out += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        out.append(f"{name}{label} {value}")


def render(llm, http_counts: dict) -> str:
    """The Prometheus exposition of `llm`'s engine and the server's request counts."""
    engine, out = llm.engine, []
    sched, stats, log = engine.scheduler, engine.stats, engine.step_log
    _line(out, "mtpkit_num_requests_running", "gauge", "requests in the running batch", [({}, len(sched.running))])
    _line(out, "mtpkit_num_requests_waiting", "gauge", "requests queued, not yet admitted", [({}, len(sched.waiting))])
    _line(out, "mtpkit_steps_total", "counter", "engine steps run", [({}, log.num_steps)])
    _line(out, "mtpkit_generation_tokens_total", "counter", "output tokens emitted", [({}, log.num_tokens)])
    _line(out, "mtpkit_generation_tokens_per_second", "gauge", "output tokens per second over the last 10 s",
          [({}, f"{log.tokens_per_second(10.0):.3f}")])
    _line(out, "mtpkit_spec_decode_num_draft_tokens_total", "counter", "draft tokens verified (finished requests)",
          [({}, stats.num_drafted)])
    _line(out, "mtpkit_spec_decode_num_accepted_tokens_total", "counter", "draft tokens accepted (finished requests)",
          [({}, stats.num_accepted)])
    _line(out, "mtpkit_spec_decode_acceptance_rate", "gauge", "accepted / drafted (finished requests)",
          [({}, f"{stats.acceptance_rate:.6f}")])
    _line(out, "mtpkit_spec_decode_mean_acceptance_length", "gauge", "tokens per verify step (finished requests)",
          [({}, f"{stats.mean_acceptance_length:.6f}")])
    free, cap = engine.kv_pools.num_free, engine.kv_pools.capacity
    _line(out, "mtpkit_kv_blocks_free", "gauge", "free KV blocks by pool", [({"pool": p}, free[p]) for p in free])
    _line(out, "mtpkit_kv_blocks_total", "gauge", "KV blocks by pool", [({"pool": p}, cap[p]) for p in cap])
    _line(out, "mtpkit_http_requests_total", "counter", "HTTP requests by endpoint and status",
          [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(http_counts.items())])
    return "\n".join(out) + "\n"
