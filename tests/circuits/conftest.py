"""circuit-tracer for the parity tests: installed and put on ``sys.path``
as for the transcoder parity tests (`tests.sae.conftest`)."""

from tests.sae.conftest import _install_circuit_tracer

_install_circuit_tracer()
