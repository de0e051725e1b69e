"""Family adapters: one per checkpoint architecture, in one registry.

See `penzai_lm.loading.families.registry` for how to add a family.
"""

from penzai_lm.loading.families.common import FamilyAdapter
from penzai_lm.loading.families.registry import ADAPTERS
from penzai_lm.loading.families.registry import adapter_for
