"""The links of one cloud node: per-link negotiation, shares of the engines and the SLO controller, tenancy
bounds, the node's measured rates, and the fidelity tables that admit wire formats."""
