"""What both daemons agree on: domain errors and their gRPC status codes, serving modes, link and sampling
parameters, the split manifest, request limits, and the checks of client text and chat prompts."""
