"""cuda-host-tracer: host-side eBPF tracing of CUDA training jobs."""

__version__ = "0.1.0"
