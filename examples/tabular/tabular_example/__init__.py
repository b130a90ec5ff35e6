"""tabular-example: Flower's fl-tabular income classifier, audited by fl-attack with one line."""
