"""What a checkpoint says about generating with it: generation_config.json's eos ids and
sampling defaults, and the tokenizer files' eos token.

eos ids are the union of config.json's, generation_config.json's (an int or a list: chat
models list the end-of-turn token there) and the eos token of tokenizer_config.json /
special_tokens_map.json (a chat template's end-of-turn token). Sampling defaults apply when
a call passes no SamplingParams: temperature, top_k and top_p where the file gives them (a
serving engine's reading: `do_sample` is not required), temperature 1.0 when it gives only
top_k / top_p, and greedy when `do_sample` is false or the file gives none of them.
`repetition_penalty` applies either way (transformers applies it to greedy search too), and
so do `presence_penalty` / `frequency_penalty` (the OpenAI names: mtpkit reads them, transformers
ignores them); `min_p` with the sampling fields (greedy rows ignore it); `bad_words_ids` as
bad_words.
"""

import dataclasses
import json
import numbers
from pathlib import Path

from mtpkit.text.chat import special_tokens
from mtpkit.errors import CheckpointError
from mtpkit.sampling.params import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_k", "top_p")


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...]
    sampling: dict      # SamplingParams fields from generation_config.json (empty: mtpkit's defaults)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling)


def read_generation_defaults(path: Path, cfg, tokenizer=None) -> GenerationDefaults:
    f = Path(path) / "generation_config.json"
    gen = {}
    if f.exists():
        try:
            gen = json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{f} is not valid JSON ({e}); copy it again or remove it") from None
    ids = set(cfg.eos_token_ids)
    eos = gen.get("eos_token_id")
    if eos is not None:
        eos = eos if isinstance(eos, list) else [eos]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
            raise CheckpointError(f"{f}: eos_token_id {gen['eos_token_id']!r} must be a token id or a list of them")
        ids.update(eos)
    eos_text = special_tokens(path).get("eos_token")
    if tokenizer is not None and eos_text is not None and (t := tokenizer.token_to_id(eos_text)) is not None:
        ids.add(t)
    sampling = {}
    given = {k: gen[k] for k in SAMPLING_FIELDS if gen.get(k) is not None}
    if given and gen.get("do_sample") is not False:
        for k, v in given.items():
            if not isinstance(v, numbers.Real) or isinstance(v, bool):
                raise CheckpointError(f"{f}: {k}={v!r} must be a number")
        sampling = {"temperature": float(given.get("temperature", 1.0))}
        if "top_k" in given:
            sampling["top_k"] = int(given["top_k"])
        if "top_p" in given:
            sampling["top_p"] = float(given["top_p"])
        if gen.get("min_p") is not None:
            sampling["min_p"] = _number(f, gen, "min_p")
    for k, off in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        if gen.get(k) is not None and gen[k] != off:
            sampling[k] = _number(f, gen, k)
    if gen.get("bad_words_ids"):
        sampling["bad_words"] = gen["bad_words_ids"]
    if sampling:
        try:
            SamplingParams(**sampling).validate(cfg.vocab_size)
        except Exception as e:
            raise CheckpointError(f"{f}: {e}") from None
    return GenerationDefaults(tuple(sorted(ids)), sampling)


def _number(f: Path, gen: dict, k: str) -> float:
    v = gen[k]
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        raise CheckpointError(f"{f}: {k}={v!r} must be a number")
    return float(v)
