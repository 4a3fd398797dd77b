"""kvoffload under LMCache: an L2 adapter plugin for LMCache's multi-process server.

:mod:`.adapter` is the plugin (it imports LMCache, so only LMCache's server
loads it); :mod:`.policy` holds what needs no LMCache: the settings, the cache
salt's tenant and the chunk identity. See docs/lmcache.md.
"""
