#!/bin/bash
# The tool of the same name in apache/kafka (kafka-tools' BrokerApiVersionsCommand): it
# succeeds only once the broker answers Kafka requests on the given listener, which a KRaft
# broker does only after it has caught up with the metadata log and been unfenced.
# A small heap and the C1 compiler only: it runs every healthcheck interval, briefly.
exec java -Xmx128m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Djava.awt.headless=true \
  -Dlog4j2.configurationFile=file:/opt/kafka/tools-log4j2.properties \
  -cp '/opt/kafka/libs/*' org.apache.kafka.tools.BrokerApiVersionsCommand "$@"
