"""The observation layer: benchmark workloads, the run record (events + step stats), the
Chrome/Perfetto trace and the lifecycle report."""
