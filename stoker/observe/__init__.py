"""What a run shows and keeps: metrics, the live panel, the verdict, summary.json and report.png."""
