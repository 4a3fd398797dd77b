"""The library the benchmarks in ``scripts/`` share; each script imports what it
needs from here, never another script.

A script runs as ``python scripts/bench_x.py`` from the repository root: Python
puts ``scripts/`` first on ``sys.path``, so ``import benchlib`` finds this
package with no path set-up; the tests find it the same way (pytest's
``pythonpath`` in pyproject.toml). This file imports nothing:
``lmcache_peer.py`` runs in LMCache's own venv, where kvoffload is not
installed, and takes only :mod:`benchlib.method`.

==========  ==================================================================
method      the measurement method, free of kvoffload: interleaved ops, page-
            cache residency and drop, a scratch dir removed on Ctrl-C, options
cpu         where a row's time goes: CPU of both processes per row, py-spy
chunks      chunk shapes, page-aligned payloads, object images, chunk keys
results     a benchmark row, held against its ceiling and its serial bound
ceilings    CPU ceilings and raw file I/O ceilings (buffered, O_DIRECT, streams)
stores      an in-process store's KEK and RAM tier
facts       the machine a run ran on, and the source tree it ran
sidecar     a real sidecar process: config, start, stop, RAM tier, socket echo
lmcache     the LMCache peer (lmcache_peer.py in its venv) and its best rows
sglang      SGLang's code on CPU (its venv): import, a real host pool, the controller stand-in
targets     the printed targets (a row against a ceiling or the peer), verdicts
events      the KV-event rows (events on vs off, publisher rate)
tables      consoles, the machine table, cells, the not-cold warning
trace       Mooncake FAST'25 traces: loading, the infinite-cache bound
vllm_engine vLLM's real v1 scheduler over a stand-in runner, its step model (vLLM venv)
live_engine that engine behind HTTP/SSE, /metrics and vLLM's ZMQ KV events (a process)
==========  ==================================================================
"""
