"""``import aitune.torch.jit.disable``: stop just-in-time tuning and put every patched module back.

Callable afterwards as ``aitune.torch.jit.disable()`` (NOTE [callable enable/disable modules]).
"""

from aitune.torch.jit._callable import make_callable
from aitune.torch.jit.runtime import disable

disable()
make_callable(__name__, disable)
