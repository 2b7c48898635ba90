"""The environment a cache is valid in: what must match for an Inductor cache entry to hit.

    cachekeeper/environment/fingerprint.py  collect (no torch import), identity (digest_of),
                                            compare and the mismatches in words;
                                            visible_gpus (the bounded GPU query)
    cachekeeper/environment/shape.py        the Fingerprint JSON object (Gpu, CpuState) and
                                            parse, its check
    cachekeeper/environment/cpu.py          the CPU state in Inductor's key (threads, ISA)
    cachekeeper/environment/devices.py      the --device grammar and coverage advice (no
                                            GPU query: callers hand in visible_gpus)

They import one way (tests/core/test_import_graph.py): fingerprint imports cpu, devices
and shape; cpu and shape import none of the others; devices imports only errors. The
per-key tier's switches that are in torch's keys are ``cachekeeper.remote_tier``'s (the
tier's protocol, which the hook and the server share); fingerprint reads them there.
A user's script imports the fingerprint as ``cachekeeper.fingerprint`` (docs/python-api.md).
This package's ``__init__`` imports nothing: the hook loads only the modules it uses.
"""
