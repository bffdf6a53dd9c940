"""A bounded memory of keys, the oldest forgotten first (the CUDA graph modules' "called
once" and "left eager" keys: keys that never repeat, such as a model's changing token
counts, must not grow it without end)."""

from collections import OrderedDict

__all__ = ["RecentKeys"]


class RecentKeys:
    """``key -> value`` for at most ``limit`` keys; ``remember`` makes a key the newest."""

    def __init__(self, limit: int):
        self.limit = limit
        self._values = OrderedDict()

    def remember(self, key, value=True):
        self._values[key] = value
        self._values.move_to_end(key)
        while len(self._values) > self.limit:
            self._values.popitem(last=False)

    def get(self, key, default=None):
        return self._values.get(key, default)

    def forget(self, key):
        """The key's value (None if not held), no longer held."""
        return self._values.pop(key, None)

    def __contains__(self, key):
        return key in self._values

    def __len__(self):
        return len(self._values)
