"""Every reason a group is dropped, one constant each (CONTRACT section 3).

The filter chain gives the first three and user filters give their own (`zero_std_0.0`
from the built-in DAPO filter); the others come from outside the chain: the group
stage's timeout, a user filter that raised, a decision that cannot be stored, and the
batch stage's seal.
"""

from __future__ import annotations

GROUP_HAS_ABORTED = "group_has_aborted"
GROUP_HAS_MISSING_REWARD = "group_has_missing_reward"
ZERO_STD_PREFIX = "zero_std_"  # + round(first reward, 1): the built-in DAPO filter
# Incomplete when its partition's event time reached first event + group_timeout_s; never
# offered to the filter chain.
GROUP_TIMEOUT = "group_timeout"
FILTER_ERROR = "filter_error"  # the run's user filter raised (dead-lettered too)
UNSTORABLE = "unstorable"  # the decision could not be built or encoded (dead-lettered too)
# Every abort of the group is a `cancelled` one sent at or after its step's seal: the seal
# itself cut it short. Counted apart (`rollout/groups_cancelled`), not as a drop.
CANCELLED_AT_SEAL = "cancelled_at_seal"
