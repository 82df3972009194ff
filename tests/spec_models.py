"""Checkpoints whose MTP head agrees with the target to a chosen degree (test helper).

Random MTP weights accept almost nothing, which tests only the a = 1 path of the verify
step. These builders make acceptance controllable:

- "bigram": every sub-layer's output projection is scaled by `eps`, so the residual stream
  stays close to the token embedding and the target behaves like a bigram model
  b(x) = argmax(lm_head . norm(E[x])). The MTP head is built to compute the same bigram on
  the token after the position (fc = [I | 0], its layer scaled by eps too), so it predicts
  what the target will predict next. eps = 0 accepts nearly everything; eps ~ 0.3 - 1 gives a
  mix of accepted counts.
- "all_accept": final norms with weight -1 zero the hidden states (y = x_norm * (1 + w)), so
  target and MTP logits are all exactly 0 and both always pick token 0.
- "all_reject": the MTP hidden state is zeroed (it always drafts token 0) and lm_head row 0 is
  zero, so the target's logit of token 0 is 0 while its largest logit is positive: token 0 is
  never the target's argmax and every draft is rejected.
"""

from pathlib import Path

import torch

import oracle


def _scale_outputs(sd: dict, prefix: str, eps: float) -> None:
    for name in list(sd):
        if not name.startswith(prefix):
            continue
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")) or \
                name.endswith(".experts.down_proj"):
            sd[name] = sd[name] * eps


def build_spec_checkpoint(path, cfg, seed: int, mode: str = "bigram", eps: float = 0.3,
                          lm_head_scale: float = 4.0, dtype=torch.float32) -> Path:
    model = oracle.build_hf_model(cfg, seed=seed, perturb_std=0.05, dtype=torch.float32,
                                  lm_head_scale=lm_head_scale)
    mtp = oracle.make_mtp_state_dict(cfg, seed=seed + 1000, std=0.05)
    H = model.config.hidden_size
    with torch.no_grad():
        sd = model.state_dict()
        if mode == "bigram":
            _scale_outputs(sd, "model.layers.", eps)
            fc = torch.zeros(H, 2 * H)
            fc[:, :H] = torch.eye(H)
            mtp["mtp.fc.weight"] = fc
            for n in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
                mtp[n] = torch.zeros(H)
            _scale_outputs(mtp, "mtp.layers.", eps)
        elif mode == "all_accept":
            sd["model.norm.weight"] = torch.full((H,), -1.0)
            mtp["mtp.norm.weight"] = torch.full((H,), -1.0)
        elif mode == "all_reject":
            mtp["mtp.norm.weight"] = torch.full((H,), -1.0)
            sd["lm_head.weight"] = sd["lm_head.weight"].clone()
            sd["lm_head.weight"][0] = 0.0
        else:
            raise ValueError(mode)
        model.load_state_dict(sd)
    model.to(dtype)
    return oracle.save_checkpoint(model, path, mtp_state=mtp)
