"""Triton's trace extension: which requests are traced (settings), what a trace holds, where it goes.

- ``shoal.settings.TraceConfig`` (there, below every layer that reads it): ``--trace-config`` at
  start (the mode: ``triton`` writes Triton's JSON trace file,
  ``opentelemetry`` exports OTLP/HTTP spans; the file, the exporter's URL and resource);
- ``settings``: the global and per-model settings of ``/v2/trace/setting`` and gRPC
  ``TraceSetting`` (level, rate, count, log frequency) in Triton 2.51's names, values and words,
  and the sampling they decide;
- ``trace``: one sampled request's timestamps (Triton's names) and the traces of the steps it
  made (an ensemble's), handed to the exporter when the request ends;
- ``export``: the two modes' writers.

Cheap when off: a request that is not sampled costs one check, and its transport one small tuple
(``trace.Origin``: when it got the request, the client's trace context).
"""
