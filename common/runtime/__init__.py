"""Process infrastructure of both daemons: settings and their command line, logs, the metrics core,
tracing, gRPC set-up, transport security, start-up checks, and the bounded tables and averages they keep."""
