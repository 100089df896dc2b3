"""The diagnostics layer: jit-side statistics (``stats``), host-side advice and
report (``report``)."""
