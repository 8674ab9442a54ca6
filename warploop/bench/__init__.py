"""`warploop bench ...`: one module per benchmark, each printing one JSON object."""
