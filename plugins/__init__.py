"""Built-in plugins. Each registers through the same hooks a third-party package uses."""
