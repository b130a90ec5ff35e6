"""opacus-example: Flower's Opacus (DP-SGD) example, audited by fl-attack with one line."""
