"""What a model line declares about its multi-token-prediction (MTP) modules (engine/mtp.py loads them,
engine/mtp_draft.py drafts with them). A line that ships them returns an MtpModule from `mtp_module()` and gives
`mtp_weight_specs(layer, has)` (the module's weights, the block's named as the target's layer `layer` would be, and
mtp.enorm / mtp.hnorm / mtp.eh_proj / mtp.norm / mtp.head) and `mtp_block(ops, w, x, layer, ctx)` (the block over
x = eh_proj(concat(enorm(e), hnorm(h))), its KV at the context's positions; returns h', the next draft's hidden
input). Lines without one return None."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MtpModule:
    count: int              # modules by the config (count_key)
    count_key: str          # the config key that says how many (DeepSeek: num_nextn_predict_layers)
    marker: str             # a tensor of the first module: the checkpoint ships it when present
    head_norm: bool         # logits = head(norm(h')) (DeepSeek's shared_head); False: h' is normed, head(h')
    masks_first: bool       # the token's embedding is zero at position 0 (vLLM's deepseek_mtp masks it there)
