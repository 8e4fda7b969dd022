"""What the gateway tells operators about itself: Prometheus metrics (read at scrape time)."""
