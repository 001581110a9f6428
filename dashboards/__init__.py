"""Dashboards: the Dash app, the static HTML report and shared figure builders."""
