"""JSON generation under a schema with the embedded models: num_spec 0 vs 3, constrained
drafting on vs off (its two halves: forced tokens substituted for forbidden drafts on the host,
"subst"; the drafters' own argmax under the grammar masks, "masks"), the verify masks filled
during the forward (overlap, the default) vs before it on the calling thread, in one process.

Prints, per model and setting: tokens/s (the faster of two runs after a warm-up run of the
same call, CPU graphs traced on first use) and its ratio to num_spec=0, the mean acceptance
length and acceptance rate, the calling thread's time per step spent on the grammar (the drafts'
checks, the wait for the masks, the bitmask's copy, the drafters' masks; with the overlap off
also the mask fill), in ms and as a share of the step, the mask fills' own time per step (on the
worker during the forward when the overlap is on), and of the host time the drafters' masks
alone (the host check of the captured proposal's drafts, and where a constrained row drafted a
forbidden token one mask per constrained row and draft pass for the proposal run again with the
masks: "draft ms/step"; "redrafted": the share of steps run again). Every constrained output is checked to be valid JSON under the schema, and
every setting's tokens to equal num_spec=0's (speculation never changes what is generated).

    python benchmarks/structured_json.py
    python benchmarks/structured_json.py --batch 8 --max-tokens 96 --model tiny-gemma4
    python benchmarks/structured_json.py --enforce-eager      # no graphs (the proposal eager anyway)
"""

import argparse
import json
import time

import jsonschema

from mtpkit import LLM, SamplingParams, SpecStats, StructuredOutputs

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                         "name": {"type": "string", "maxLength": 12},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                         "active": {"type": "boolean"}},
          "required": ["id", "name", "tags", "active"], "additionalProperties": False}
PROMPTS = ["The record:", "User profile as JSON:", "def to_json(self):", "Output:", "{", "Item", "Data: ",
           "Response"]


def run(llm: LLM, prompts, params):
    llm.stats = SpecStats(num_spec=llm.engine_config.num_spec)
    masks = llm.runner.structured
    masks.host_seconds, masks.steps, masks.worker_seconds, masks.draft_seconds = 0.0, 0, 0.0, 0.0
    masks.masked_proposals = 0
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    return (outs, elapsed, masks.host_seconds + masks.draft_seconds, masks.steps, llm.stats, masks.worker_seconds,
            masks.draft_seconds, masks.masked_proposals)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None, help="default: both embedded models")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--enforce-eager", action="store_true", help="no graphs: every proposal eager")
    args = ap.parse_args(argv)
    prompts = (PROMPTS * ((args.batch + len(PROMPTS) - 1) // len(PROMPTS)))[:args.batch]
    params = SamplingParams(max_tokens=args.max_tokens,
                            structured_outputs=StructuredOutputs(json=SCHEMA, disable_any_whitespace=True))
    for name in args.model or ["tiny-qwen3-next", "tiny-gemma4"]:
        print(f"== {name}: batch {args.batch}, max_tokens {args.max_tokens}, greedy, schema of "
              f"{len(SCHEMA['properties'])} fields" + (", enforce_eager" if args.enforce_eager else ""))
        print(f"{'setting':<46} {'tok/s':>8} {'ratio':>6} {'accept len':>10} {'accept rate':>11} "
              f"{'host ms/step':>12} {'host share':>10} {'fill ms/step':>12} {'draft ms/step':>13} {'redrafted':>9}")
        base_tokens, base_rate = None, None
        for num_spec, subst, masked, overlap in ((0, True, True, True), (3, False, False, True), (3, True, False, True),
                                                 (3, False, True, True), (3, True, True, False), (3, True, True, True)):
            llm = LLM(name, num_spec=num_spec, enforce_eager=args.enforce_eager)
            llm.runner.structured.constrained_drafting = subst
            llm.runner.structured.masked_drafting = masked
            llm.runner.structured.overlap = overlap
            if llm.runner.graphs is not None:
                llm.runner.graphs.trace_after = 0      # long-lived engine: CPU graphs traced on first use
            run(llm, prompts, params)                  # warm-up: the same generations trace every shape
            # the faster of two timed runs (the machine may be shared)
            outs, elapsed, host, steps, stats, fill, draft, redrafted = min((run(llm, prompts, params) for _ in range(2)),
                                                                 key=lambda r: r[1])
            for o in outs:
                if o.finish_reason == "stop":
                    jsonschema.validate(json.loads(o.text), SCHEMA)
            tokens = [o.token_ids for o in outs]
            if base_tokens is None:
                base_tokens = tokens
            assert tokens == base_tokens, f"{name} num_spec={num_spec}: the tokens differ from num_spec=0"
            n = sum(len(t) for t in tokens)
            rate = n / elapsed
            base_rate = base_rate or rate
            label = "num_spec=0" if not num_spec else (
                f"num_spec={num_spec}, subst {'on' if subst else 'off'}, masks {'on' if masked else 'off'}, "
                f"overlap {'on' if overlap else 'off'}")
            print(f"{label:<46} {rate:8.1f} {rate / base_rate:6.2f} {stats.mean_acceptance_length:10.2f} "
                  f"{stats.acceptance_rate:11.2f} {1e3 * host / max(steps, 1):12.3f} "
                  f"{host / elapsed:10.1%} {1e3 * fill / max(steps, 1):12.3f} {1e3 * draft / max(steps, 1):13.3f} "
                  f"{redrafted / max(steps, 1):9.0%}")
            # Closed before the next is built: an LLM closed after another was built gives the
            # process back its thread count, under the next one (which then runs on 2+ threads).
            llm.close()
        done = sum(o.finish_reason == "stop" for o in outs)
        print(f"   {done}/{len(outs)} outputs complete (valid under the schema); all settings' tokens identical\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
