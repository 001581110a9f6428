"""Dashboards: the Dash app, the static HTML report and shared figure builders.

    data.py      analysis results per (analysis, parameters, filters, data version)
    figures.py   plotly figures from analysis frames (shared by the app and the report)
    report.py    the static HTML report
    app.py       the Dash app; pages/ its pages; deadline.py its server's body-read deadlines
    grafana_dashboard.py   the Grafana dashboard of ``kvscope serve``'s /metrics, generated
    prometheus_alerts.py   Prometheus alert rules for kvscope's series, generated
"""

__all__ = ["app", "data", "deadline", "figures", "grafana_dashboard", "pages", "prometheus_alerts",
           "report"]
