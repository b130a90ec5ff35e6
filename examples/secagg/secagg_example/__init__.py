"""secagg-example: a Flower app with SecAgg+, audited by fl-attack."""
