"""cnn-example: Flower's quickstart-pytorch CNN, audited by fl-attack with one line in the ServerApp."""
