"""The policy loss with its settings, counts and row tensors as keywords, as the loss tests write them:
`loss_with(logp, old_logp, advantages, mask, clip_c=3.0, global_num_tokens=12, group_ids=ids)` is rl/loss.py's
`policy_loss(logp, old_logp, advantages, mask, LossSettings(clip_c=3.0), GlobalCounts(tokens=12), group_ids=ids)`."""

from rl.loss import LossSettings, policy_loss
from rl.loss_modes import GlobalCounts

COUNTS = {"global_num_tokens": "tokens", "global_num_seqs": "seqs", "global_num_groups": "groups"}
ROWS = ("token_weights", "group_ids", "group_num_tokens")


def loss_with(logp, old_logp, advantages, mask, **keywords):
    counts = GlobalCounts(**{COUNTS[k]: keywords.pop(k) for k in list(keywords) if k in COUNTS})
    rows = {k: keywords.pop(k) for k in list(keywords) if k in ROWS}
    return policy_loss(logp, old_logp, advantages, mask, LossSettings(**keywords), counts, **rows)
