"""Which route a turn takes: the router, the TTFT cost model and the end-to-end occupancy model."""
