"""The HTTP routers, one module per resource (as the FastAPI template's ``api/routes/``).

Each module holds an ``APIRouter`` named ``router`` that only translates HTTP: it parses the
request, makes one call to its resource's service (``server/services.py``; the tier's: ``app.state.tier``) through the dependencies in ``server/deps.py``
and ``server/auth.py``, and lets the error table answer failures. ``server/app.py`` includes
each router directly; nothing here registers itself.

- ``admin``: ``/healthz``, ``/metrics``, ``POST /v1/gc``
- ``resolve``: ``/v1/resolve``
- ``blobs``: ``/v1/blobs``
- ``snapshots``: ``/v1/snapshots``
- ``workloads``: ``/v1/workloads``
- ``agents``: ``/v1/agents``, ``/v1/status``
- ``reports``: ``/v1/reports``
- ``ui``: the status page (``/``, ``/ui``)
"""
