"""Serving inlinelm beyond one process: :mod:`inlinelm.serve.ray` runs many engines on Ray Serve.

:mod:`.prefix` (prefix-affinity routing) and :mod:`.forward` (a request carried whole to a
replica) need no Ray; :mod:`.ray` (with :mod:`.ray_replica`, :mod:`.ray_ingress`, :mod:`.ray_local`) and
:mod:`.ray_router` need ``pip install 'inlinelm[ray]'``.
"""
